"""The load driver: client processes posting with Idempotency-Key, and the checks on what came
back.

Each client process runs a few threads. Each thread, until the deadline, mostly posts new keys,
sometimes (``retry_fraction``) posts one of its earlier keys again after it was answered (a
sequential retry), and sometimes (``duplicate_fraction``) posts a new key from two threads at
the same instant (a concurrent duplicate). Every request's outcome is recorded; the effect of a
request is one Widget row named after its key, so effects are counted per key in the database.

No Django here: the clients are plain HTTP, in processes of their own (spawned, so they share
nothing with the pytest process).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import random
import statistics
import threading
import time
import uuid
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

#: Every way the app guards a view: the DRF mixin, ``@idempotent`` on a plain view, and the
#: middleware (MIDDLEWARE_PATHS in tests/settings.py). Each key keeps its path.
PATHS = ("/api/widget/", "/plain/function/", "/plain/middleware/")
REPLAY_HEADER = "Idempotent-Replay"
PROBLEM_JSON = "application/problem+json"


@dataclass(frozen=True)
class LoadConfig:
    port: int
    seconds: float
    processes: int = 4
    threads: int = 2
    retry_fraction: float = 0.10
    duplicate_fraction: float = 0.05
    #: Share of new keys whose view sleeps ``slow_seconds`` inside its transaction.
    slow_fraction: float = 0.0
    slow_seconds: float = 0.0
    paths: tuple[str, ...] = PATHS
    prefix: str = field(default_factory=lambda: f"load-{uuid.uuid4().hex[:8]}")
    #: ``time.time()`` at which every client starts, so fault timings line up with the load.
    start_at: float = 0.0
    timeout: float = 60

    @property
    def deadline(self) -> float:
        return self.start_at + self.seconds

    def request_for(self, key: str) -> tuple[str, bytes]:
        """The path and body every request with ``key`` sends: both follow from the key, so a
        test can repeat any key it reads back from the database."""
        body: dict[str, Any] = {"name": key}
        if key.endswith("-slow"):
            body["sleep"] = self.slow_seconds
        return self.paths[zlib.crc32(key.encode()) % len(self.paths)], json.dumps(body).encode()


@dataclass
class Outcome:
    """One request and what came back; ``status`` None means no HTTP answer at all."""

    key: str
    kind: str  # "first", "retry", "duplicate" or "settle"
    path: str
    payload: bytes
    started: float
    finished: float
    status: int | None = None
    replay: str | None = None
    retry_after: str | None = None
    content_type: str | None = None
    body: bytes = b""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def json(self) -> Any:
        return json.loads(self.body)


def post(port: int, key: str, path: str, payload: bytes, kind: str, *, timeout: float = 60,
         barrier: threading.Barrier | None = None) -> Outcome:  # fmt: skip
    """POST ``payload`` with ``key``; with a barrier, connect first and send when both are ready."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    outcome = Outcome(key, kind, path, payload, started=0.0, finished=0.0)
    try:
        if barrier is not None:
            connection.connect()
            barrier.wait(timeout)
        outcome.started = time.time()
        connection.request(
            "POST",
            path,
            body=payload,
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )
        response = connection.getresponse()
        outcome.body = response.read()
        outcome.status = response.status
        outcome.replay = response.getheader(REPLAY_HEADER)
        outcome.retry_after = response.getheader("Retry-After")
        outcome.content_type = response.getheader("Content-Type")
    except (OSError, http.client.HTTPException, threading.BrokenBarrierError) as exc:
        outcome.error = repr(exc)
    finally:
        outcome.started = outcome.started or time.time()
        outcome.finished = time.time()
        connection.close()
    return outcome


def _thread(config: LoadConfig, name: str, outcomes: list[Outcome]) -> None:
    rng = random.Random(name)
    answered: list[tuple[str, str, bytes]] = []
    count = 0

    def new_key() -> tuple[str, str, bytes]:
        nonlocal count
        count += 1
        slow = rng.random() < config.slow_fraction
        key = f"{name}-{count}{'-slow' if slow else ''}"
        return key, *config.request_for(key)

    while time.time() < config.deadline:
        roll = rng.random()
        if roll < config.retry_fraction and answered:
            key, path, payload = rng.choice(answered)
            outcomes.append(post(config.port, key, path, payload, "retry", timeout=config.timeout))
            continue
        key, path, payload = new_key()
        if roll < config.retry_fraction + config.duplicate_fraction:
            first = duplicate(config.port, key, path, payload, timeout=config.timeout)
        else:
            first = [post(config.port, key, path, payload, "first", timeout=config.timeout)]
        outcomes.extend(first)
        if any(outcome.ok for outcome in first):
            answered.append((key, path, payload))


def duplicate(
    port: int, key: str, path: str, payload: bytes, *, timeout: float = 60
) -> list[Outcome]:
    """The same request from two threads at once (both connected, released by a barrier)."""
    barrier = threading.Barrier(2)
    results: list[Outcome] = []
    other = threading.Thread(
        target=lambda: results.append(
            post(port, key, path, payload, "duplicate", timeout=timeout, barrier=barrier)
        )
    )
    other.start()
    mine = post(port, key, path, payload, "duplicate", timeout=timeout, barrier=barrier)
    other.join(timeout * 2)
    return [mine, *results]


def run_client(config: LoadConfig, index: int) -> list[Outcome]:
    """One client process: ``config.threads`` threads, from ``start_at`` to the deadline."""
    time.sleep(max(0.0, config.start_at - time.time()))
    per_thread: list[list[Outcome]] = [[] for _ in range(config.threads)]
    threads = [
        threading.Thread(target=_thread, args=(config, f"{config.prefix}-{index}-{n}", out))
        for n, out in enumerate(per_thread)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [outcome for out in per_thread for outcome in out]


class Load:
    """The client processes, started on enter; ``results()`` waits for them."""

    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self._pool: Any = None
        self._async: Any = None

    def __enter__(self) -> Load:
        context = multiprocessing.get_context("spawn")
        self._pool = context.Pool(self.config.processes)
        self._async = self._pool.starmap_async(
            run_client, [(self.config, index) for index in range(self.config.processes)]
        )
        return self

    def results(self) -> list[Outcome]:
        wait = self.config.deadline - time.time() + self.config.timeout * 2 + 60
        batches: list[list[Outcome]] = self._async.get(timeout=max(wait, 1))
        return [outcome for batch in batches for outcome in batch]

    def __exit__(self, *exc: object) -> None:
        self._pool.terminate()
        self._pool.join()


def settle(port: int, outcomes: Iterable[Outcome], deadline: float = 60) -> list[Outcome]:
    """Retry every key that has no 2xx answer yet, honouring Retry-After, until it has one."""
    first: dict[str, Outcome] = {}
    answered: set[str] = set()
    for outcome in outcomes:
        first.setdefault(outcome.key, outcome)
        if outcome.ok:
            answered.add(outcome.key)
    pending = [key for key in first if key not in answered]
    end = time.monotonic() + deadline

    def retry(key: str) -> list[Outcome]:
        tries: list[Outcome] = []
        while time.monotonic() < end:
            outcome = post(port, key, first[key].path, first[key].payload, "settle")
            tries.append(outcome)
            if outcome.ok:
                break
            wait = float(outcome.retry_after or 0.5) if outcome.status else 0.5
            time.sleep(min(wait, 3.0))
        return tries

    with ThreadPoolExecutor(8) as pool:
        return [outcome for tries in pool.map(retry, pending) for outcome in tries]


# --- checks and figures ------------------------------------------------------------------------


def widgets(connection: Any, prefix: str) -> dict[str, list[int]]:
    """Widget ids per name, for the names of this run: one row per effect."""
    rows = connection.execute(
        "SELECT name, id FROM testapp_widget WHERE name LIKE %s", [f"{prefix}-%"]
    ).fetchall()
    found: dict[str, list[int]] = defaultdict(list)
    for name, pk in rows:
        found[name].append(pk)
    return found


def records(connection: Any, prefix: str) -> dict[str, tuple[str, int]]:
    """The idempotency record of each key of this run: (status, attempts)."""
    rows = connection.execute(
        "SELECT key, status, attempts FROM django_idempotency_idempotencyrecord WHERE key LIKE %s",
        [f"{prefix}-%"],
    ).fetchall()
    return {key: (status, attempts) for key, status, attempts in rows}


def read_back(
    database: Any, prefix: str
) -> tuple[dict[str, list[int]], dict[str, tuple[str, int]]]:
    """What the run left in ``database`` (a private cluster): effects and records by key."""
    with database.connect() as connection:
        return widgets(connection, prefix), records(connection, prefix)


def violations(
    outcomes: list[Outcome],
    effects: dict[str, list[int]],
    *,
    allowed: frozenset[int | None] = frozenset({201, 409}),
    keys: dict[str, tuple[str, int]] | None = None,
) -> list[str]:
    """Everything that breaks exactly-once or the HTTP contract; empty when all is well.

    Per key: every 2xx names the one Widget row of that key; at most one 2xx says it is not a
    replay; every replay repeats the original's status and body byte for byte; every 409 has
    a Retry-After; every 503 is problem+json without a traceback. Every key ended with a 2xx,
    and has exactly one effect; with ``keys`` (from :func:`records`), its record is COMPLETED,
    so no key is left stuck.
    """
    problems: list[str] = []
    by_key: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_key[outcome.key].append(outcome)
    for name, ids in effects.items():
        if name not in by_key:
            problems.append(f"{name}: {len(ids)} effect(s) for a key never sent")
    for key, answers in by_key.items():
        problems += _key_violations(key, answers, effects.get(key, []), allowed)
        if keys is not None and keys.get(key, ("absent", 0))[0] != "COMPLETED":
            problems.append(f"{key}: record is {keys.get(key, ('absent', 0))}, not COMPLETED")
    return problems


def _key_violations(
    key: str, answers: list[Outcome], ids: list[int], allowed: frozenset[int | None]
) -> list[str]:
    problems = []
    for outcome in answers:
        problems += [f"{key}: {p}" for p in _answer_violations(outcome, ids, allowed)]
    successes = [outcome for outcome in answers if outcome.ok]
    if not successes:
        problems.append(f"{key}: never answered 2xx ({[o.status for o in answers]})")
    if len(ids) != 1:
        problems.append(f"{key}: {len(ids)} effects, expected exactly one")
    originals = [outcome for outcome in successes if outcome.replay == "false"]
    if len(originals) > 1:
        problems.append(f"{key}: {len(originals)} answers ran the view (no replay)")
    reference = originals[0] if originals else (successes[0] if successes else None)
    for outcome in successes:
        assert reference is not None
        if (outcome.status, outcome.body) != (reference.status, reference.body):
            problems.append(
                f"{key}: replay differs from the original: {outcome.status} {outcome.body!r} "
                f"!= {reference.status} {reference.body!r}"
            )
    return problems


def _answer_violations(
    outcome: Outcome, ids: list[int], allowed: frozenset[int | None]
) -> list[str]:
    if outcome.status not in allowed:
        return [f"{outcome.kind} got {outcome.status} {outcome.error or ''} {outcome.body[:300]!r}"]
    if outcome.status is None:
        return []
    if outcome.ok:
        problems = []
        if outcome.replay not in ("true", "false"):
            problems.append(f"2xx without a valid {REPLAY_HEADER}: {outcome.replay!r}")
        body = outcome.json()
        if body.get("name") != outcome.key or [body.get("id")] != ids:
            problems.append(f"2xx body {body} does not name the key's one effect {ids}")
        return problems
    problems = []
    if outcome.content_type != PROBLEM_JSON:
        problems.append(f"{outcome.status} is {outcome.content_type}, not {PROBLEM_JSON}")
    if b"Traceback" in outcome.body or b'File "' in outcome.body:
        problems.append(f"{outcome.status} body shows a traceback: {outcome.body[:300]!r}")
    if not (outcome.retry_after or "").isdigit() or int(outcome.retry_after or 0) < 1:
        problems.append(f"{outcome.status} without a Retry-After: {outcome.retry_after!r}")
    expected = {409: None, 503: "idempotency_store_unavailable"}.get(outcome.status)
    if expected and outcome.json().get("error") != expected:
        problems.append(f"{outcome.status} with error {outcome.json().get('error')!r}")
    return problems


def report(capsys: Any, name: str, stats: dict[str, Any]) -> None:
    """Figures are printed past pytest's capture, never asserted on: the machine's speed is not
    under test."""
    with capsys.disabled():
        print(f"\n[reliability] {name}: {json.dumps(stats)}")


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


def figures(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    """Counts for the report: throughput, how duplicates were answered, latencies."""
    by_key: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in sorted(outcomes, key=lambda o: o.started):
        by_key[outcome.key].append(outcome)
    statuses = Counter(o.status for o in outcomes)
    latencies = sorted(o.finished - o.started for o in outcomes if o.status is not None)
    return {
        "requests": len(outcomes),
        "requests_per_second": round(len(outcomes) / seconds, 1),
        "keys": len(by_key),
        "sequential_retries": sum(o.kind == "retry" for o in outcomes),
        "sequential_retries_409": sum(o.kind == "retry" and o.status == 409 for o in outcomes),
        "concurrent_duplicates": sum(o.kind == "duplicate" for o in outcomes) // 2,
        # Requests beyond the first of their key: sequential retries, the second of each pair.
        "duplicates": len(outcomes) - len(by_key),
        "replays": sum(o.ok and o.replay == "true" for o in outcomes),
        "conflicts_409": statuses.get(409, 0),
        "unavailable_503": statuses.get(503, 0),
        "no_answer": statuses.get(None, 0),
        "statuses": dict(sorted(((str(k), v) for k, v in statuses.items()))),
        "by_path": dict(Counter(o.path for o in outcomes)),
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
        "latency_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 1)
        if latencies
        else None,
    }
