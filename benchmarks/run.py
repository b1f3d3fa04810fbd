"""HTTP benchmark: two DRF create endpoints under gunicorn on PostgreSQL, driven by wrk.

The demo's payment POST (the heavier endpoint) and the lightest create there is (a three-field
note), each plain, guarded by ours and by the peers; and the same server's bare GET, the ceiling
a replay can reach, with a bare POST beside it (a note replay's request answered by a view that
does nothing: the part of a replay's cost that is the request's own), and the floors (what any
idempotency layer must do at the least, done by a view with no layer's code: ``FLOORS``; the
replay floors read a stored answer seeded for every key they are sent, ``prepare_floors``).
Every variant runs in its own gunicorn (see ``benchproject/settings.py``); rows are measured in
interleaved rounds and reported as medians, with each row's throughput and CPU per request
relative to the plain endpoint, replays also relative to the ceiling. Per request it reports the
workers' CPU, the PostgreSQL backends' CPU, the SQL statements the workers ran and the commits
the database counted. Every request of every row carries the same ``Authorization`` header, and
every key a body of its own.

The cold replay rows send each key once to a second server of ours that never saw it
(``ColdKeys``): what a retry costs when it lands on another process than its first request.

It ends with a verdict: each of issue 40's targets (``TARGETS``: ours over its floor, over the
best peer on the same storage in every round, first-time CPU over the floor's), PASS or FAIL;
the exit status does not depend on it. A full run writes its report to ``--output`` and to
``benchmarks/results/http.json``. ``--smoke`` runs a few requests per row and fails on any
error.

    python -m benchmarks.run [--rounds 9] [--duration 2] [--smoke]

Nine rounds of 2 s rather than three of 6 (the same time): this host's speed moves by up to
a quarter within seconds, and a median of nine pairs moves less from one run to the next.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.benchproject import counting

ROOT = Path(__file__).resolve().parent.parent
LUA = Path(__file__).resolve().parent / "request.lua"
#: Payments move between these many accounts, so requests do not all queue on the same two
#: rows; each request's pair is fixed by its key (request.lua does the same), which keeps a
#: replayed request's body identical to the original's.
ACCOUNTS = 200


def body_for(number: int) -> str:
    """The payment sent with replay key ``number`` (request.lua's ``body_for(0, number)``): its
    accounts and amount follow the number, so no two keys' bodies are the same."""
    source = number % ACCOUNTS + 1
    destination = (number + 1) % ACCOUNTS + 1
    amount = number // ACCOUNTS % 1000 + 1
    return json.dumps(
        {"amount": f"{amount}.00", "currency": "USD", "source_account": f"acc_{source}",
         "destination_account": f"acc_{destination}"},
        separators=(", ", ": "),
    )  # fmt: skip


def note_body(number: int) -> str:
    """The note sent with replay key ``number`` (request.lua's ``body_for(0, number)``): its
    title names the key, so no two keys' bodies are the same (a fingerprint computed once per
    body would otherwise serve every request after the first)."""
    note = {"title": f"bench 0000-{number:012x}", "body": "a note", "done": False}
    return json.dumps(note, separators=(", ", ": "))


BODY = body_for(0)
NOTE_BODY = note_body(0)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    variant: str
    port: int
    process: subprocess.Popen[bytes] | None = None
    #: Replay keys per endpoint, created before the rounds (a key belongs to one path).
    replay_prefixes: dict[str, str] = field(default_factory=dict)

    def replay_prefix(self, endpoint: Endpoint) -> str:
        return self.replay_prefixes.setdefault(endpoint.name, secrets.token_hex(4))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_pids(self) -> list[int]:
        assert self.process is not None
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()]

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(pid) for pid in self.worker_pids())


@dataclass(frozen=True)
class Endpoint:
    name: str
    guarded: str  # the path ours and the peers guard
    plain: str  # the same view without idempotency
    body: str  # request.lua's BENCH_BODY


@dataclass(frozen=True)
class Row:
    label: str
    server: str
    endpoint: Endpoint | None  # None: the bare GET
    mode: str  # first | replay | cold | none | get (request.lua's BENCH_MODE)
    group: str  # rows that do the same work share a group, for "ahead of every peer"
    #: The endpoint whose plain row "× plain" compares with (None: this row's own endpoint).
    baseline: Endpoint | None = None

    @property
    def path(self) -> str:
        if self.endpoint is None:
            return "/get/"
        return self.endpoint.plain if self.mode == "none" else self.endpoint.guarded


PAYMENTS = Endpoint("payments", "/api/v1/payments/", "/plain/payments/", "payment")
NOTES = Endpoint("notes", "/api/v1/notes/", "/plain/notes/", "note")
#: The server of a variant (the same settings) that serves the cold replay rows: it is sent
#: keys that the first server created (and, with Redis, replayed once, which made their copy).
COLD = {"ours": "ours-cold", "ours-redis": "ours-redis-cold"}
#: What guards the endpoint, and the storage it keeps keys in ("first-db" groups with "first-db").
GUARDS = [
    ("ours", "ours", "database"),
    ("ours", "ours-redis", "Redis"),
    # The same Redis copy behind IdempotencyMiddleware: a replay answered before DRF runs.
    ("ours, middleware", "ours-middleware", "Redis"),
    ("drf-idempotency", "drfi-db", "database"),
    ("drf-idempotency", "drfi-redis", "Redis"),
    ("django-idempotency-key", "dik", "Redis"),
    ("drf-idempotencykey", "drfik", "database"),
]


def endpoint_rows(endpoint: Endpoint) -> list[Row]:
    rows = [Row(f"{endpoint.name}: plain, no idempotency", "ours", endpoint, "none", "plain")]
    for name, server, storage in GUARDS:
        group = "db" if storage == "database" else "redis"
        for mode, what in (("first", "first-time"), ("replay", "replays")):
            label = f"{endpoint.name}: {name}, {what}, {storage}"
            rows.append(Row(label, server, endpoint, mode, f"{mode}-{group}"))
        if endpoint is NOTES and server in COLD:
            # Each retry reaches a process that has never seen its key (``ColdKeys``).
            label = f"{endpoint.name}: {name}, replays, {storage}, cold"
            rows.append(Row(label, COLD[server], endpoint, "cold", f"replay-{group}-cold"))
    # Replays answered from each worker's memory (LOCAL_REPLAY_SECONDS): no peer keeps answers
    # there, so the row has a group of its own; its first-time path is the database row's.
    label = f"{endpoint.name}: ours, replays, kept in memory (database behind)"
    rows.append(Row(label, "ours-memory", endpoint, "replay", "replay-memory"))
    return rows


CEILING = Row("bare GET (ceiling)", "ours", None, "get", "ceiling")
#: A note replay's request (its headers and body) answered by a view that does nothing with it:
#: what that request costs the server and the client before any idempotency work, beside the GET.
BARE_POST = Row(
    "bare POST (a note replay's request, nothing done)",
    "ours",
    Endpoint("bare POST", "/post/", "/post/", "note"),
    "replay",
    "ceiling-post",
)
#: What any idempotency layer must do at the least, done by a view with no layer's code
#: (``benchproject.views``): no layer can pass its floor on the same machine.
REDIS_FLOOR = Row(
    "floor: bare POST + one Redis GET, kept connection (a replay from Redis)",
    "ours",
    Endpoint("Redis floor", "/floor/redis/", "/floor/redis/", "note"),
    "replay",
    "floor-redis",
)
DATABASE_FLOOR = Row(
    "floor: bare POST + one prepared SELECT by (scope, key) (a replay from the database)",
    "ours",
    Endpoint("database floor", "/floor/database/", "/floor/database/", "note"),
    "replay",
    "floor-db",
)
FIRST_TIME_FLOOR = Row(
    "floor: notes plain + a claim committed before it, completed in it (first-time)",
    "ours",
    Endpoint("first-time floor", "/floor/notes/", "/floor/notes/", "note"),
    "first",
    "floor-first",
    baseline=NOTES,
)
#: A layer that answers replays from Redis looks there before it claims a new key.
FIRST_TIME_REDIS_FLOOR = Row(
    "floor: first-time floor + one Redis GET (miss)",
    "ours",
    Endpoint("first-time Redis floor", "/floor/notes/redis/", "/floor/notes/redis/", "note"),
    "first",
    "floor-first-redis",
    baseline=NOTES,
)
# A layer inside DRF's view (a mixin) knows the caller, its keys' scope, only after DRF's
# request and authentication: these two floors pay for those, and for nothing else of DRF's.
DRF_REDIS_FLOOR = Row(
    "floor: DRF authentication + one Redis GET (a replay from Redis, inside DRF)",
    "ours",
    Endpoint("DRF Redis floor", "/floor/drf/redis/", "/floor/drf/redis/", "note"),
    "replay",
    "floor-drf-redis",
)
DRF_DATABASE_FLOOR = Row(
    "floor: DRF authentication + one prepared SELECT (a replay from the database, inside DRF)",
    "ours",
    Endpoint("DRF database floor", "/floor/drf/database/", "/floor/drf/database/", "note"),
    "replay",
    "floor-drf-db",
)
FLOORS = [
    REDIS_FLOOR, DATABASE_FLOOR, FIRST_TIME_FLOOR, FIRST_TIME_REDIS_FLOOR, DRF_REDIS_FLOOR,
    DRF_DATABASE_FLOOR,
]  # fmt: skip
#: The floors that read a stored answer: ``prepare_floors`` seeds one under every key they send.
SEEDED_FLOORS = [REDIS_FLOOR, DATABASE_FLOOR, DRF_REDIS_FLOOR, DRF_DATABASE_FLOOR]
ROWS = [*endpoint_rows(PAYMENTS), *endpoint_rows(NOTES), CEILING, BARE_POST, *FLOORS]
#: Groups compared with the ceiling ("× ceiling").
AGAINST_CEILING = ("ceiling-post", "floor-redis", "floor-db", "floor-drf-redis", "floor-drf-db")
#: Groups that are a baseline themselves: no added latency to report.
BASELINES = ("plain", "ceiling", "ceiling-post", *AGAINST_CEILING[1:])
#: Our notes rows (by label) and the floors each is held to ("ours / floor"), the first being
#: the one its verdict uses: the layer's own distance from the least its guarantee costs, which
#: the host's speed moves far less than "× ceiling".
AGAINST_FLOORS: dict[str, tuple[Row, ...]] = {
    "notes: ours, replays, database": (DATABASE_FLOOR, DRF_DATABASE_FLOOR),
    "notes: ours, replays, database, cold": (DATABASE_FLOOR,),
    "notes: ours, replays, Redis": (REDIS_FLOOR, DRF_REDIS_FLOOR),
    "notes: ours, replays, Redis, cold": (REDIS_FLOOR,),
    "notes: ours, middleware, replays, Redis": (REDIS_FLOOR,),
    "notes: ours, first-time, database": (FIRST_TIME_FLOOR,),
    "notes: ours, first-time, Redis": (FIRST_TIME_REDIS_FLOOR, FIRST_TIME_FLOOR),
    "notes: ours, middleware, first-time, Redis": (FIRST_TIME_REDIS_FLOOR, FIRST_TIME_FLOOR),
}
if not set(AGAINST_FLOORS) <= {row.label for row in ROWS}:  # a renamed row, caught at import
    raise RuntimeError(f"AGAINST_FLOORS names rows that do not exist: {set(AGAINST_FLOORS)}")


def measuring_order() -> list[Row]:
    """The rows in the order a round measures them: each floor right after the first of our
    rows held to it, and the other rows whose verdict it is right after the floor, so that a
    row and its floor run seconds apart, not minutes (this host's speed drifts within a
    round). Rotated each round, which keeps them next to each other."""
    order: list[Row] = []
    for row in ROWS:
        if row in FLOORS or row in order:
            continue
        order.append(row)
        for floor in AGAINST_FLOORS.get(row.label, ()):
            if floor not in order:
                order.append(floor)
                order += [
                    other
                    for other in ROWS
                    if other not in order and AGAINST_FLOORS.get(other.label, (None,))[0] is floor
                ]
    return order + [floor for floor in FLOORS if floor not in order]


VARIANTS = [
    "ours", "ours-redis", "ours-memory", "ours-middleware", "drfi-db", "drfi-redis", "dik",
    "drfik", *COLD.values(),
]  # fmt: skip
#: The ``Authorization`` header every client of every variant sends, so that every row sends
#: the same request: the middleware scopes keys by it (it answers replays before DRF's
#: authentication runs); the benchmark's DRF authentication ignores it.
AUTHORIZATION = "Token bench-client"


def environment(variant: str, args: argparse.Namespace) -> dict[str, str]:
    return {
        **os.environ,
        "BENCH_VARIANT": variant,
        "BENCH_DATABASE_URL": args.database_url,
        "BENCH_REDIS_URL": args.redis_url,
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
        "PYTHONPATH": str(ROOT),
    }


def django(args: argparse.Namespace, code: str) -> None:
    subprocess.run(
        [sys.executable, "-c", f"import django; django.setup()\n{code}"],
        env=environment("all", args),
        cwd=ROOT,
        check=True,
    )


def prepare_database(args: argparse.Namespace) -> None:
    """Create the database if needed, migrate every app, start from empty tables."""
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        env=environment("all", args),
        cwd=ROOT,
        check=True,
    )
    django(
        args,
        "from django.apps import apps\n"
        "from django.contrib.auth import get_user_model\n"
        "from demo_project.payments.models import Account\n"
        "for config in apps.get_app_configs():\n"
        "    if config.label in ('django_idempotency', 'idempotency_key', 'drf_idempotency',"
        " 'drf_idempotencykey', 'payments', 'bench_notes'):\n"
        "        for model in config.get_models():\n"
        "            if model is not Account:\n"
        "                model.objects.all().delete()\n"
        "get_user_model().objects.get_or_create(username='bench')\n"
        f"for number in range(1, {ACCOUNTS} + 1):\n"
        "    Account.objects.get_or_create(name=f'acc_{number}', defaults={'balance': 10**9})\n",
    )


def create_database(args: argparse.Namespace) -> None:
    """CREATE DATABASE when it does not exist yet (PostgreSQL)."""
    import psycopg

    name = args.database_url.rsplit("/", 1)[1]
    admin_url = args.database_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def start(server: Server, args: argparse.Namespace) -> None:
    server.process = subprocess.Popen(
        [
            sys.executable, "-m", "gunicorn", "benchmarks.benchproject.wsgi:application",
            "--workers", str(args.workers), "--bind", f"127.0.0.1:{server.port}",
            "--log-level", "warning", "--backlog", "2048",
            # Every server would bind the same control socket (~/.gunicorn/gunicorn.ctl).
            "--no-control-socket",
        ],
        env=environment(server.variant, args),
        cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip


def wait_until_up(server: Server) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(server.base + "/get/", timeout=2):
                return
        except OSError:  # refused, reset, or not answering yet
            time.sleep(0.2)
    raise RuntimeError(f"{server.variant} server did not start")


def stop(server: Server) -> None:
    if server.process is not None and server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(30)


def post(
    url: str, key: str | None, body: str = BODY, extra: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", "Authorization": AUTHORIZATION, **(extra or {})}
    if key is not None:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def replay_key(server: Server, endpoint: Endpoint, number: int) -> str:
    return f"{server.replay_prefix(endpoint)}-0000-4000-8000-{number:012x}"


def create_replay_keys(server: Server, endpoint: Endpoint, count: int) -> None:
    for number in range(count):
        key = replay_key(server, endpoint, number)
        body = body_for(number) if endpoint is PAYMENTS else note_body(number)
        status, _, answer = post(server.base + endpoint.guarded, key, body)
        if status != 201:
            raise RuntimeError(f"{server.variant}: creating a replay key got {status}: {answer!r}")


def duplicates_let_through(server: Server, attempts: int = 8) -> int:
    """Fire one new key from several clients at once; count the payments it created."""
    key = f"{secrets.token_hex(4)}-ffff-4000-8000-000000000000"
    url = server.base + "/api/v1/payments/"
    with concurrent.futures.ThreadPoolExecutor(attempts) as pool:
        results = list(pool.map(lambda _: post(url, key, BODY), range(attempts)))
    created = {json.loads(body)["transaction_id"] for status, _, body in results if status == 201}
    return len(created)


def prepare_floors(servers: dict[str, Server], args: argparse.Namespace) -> None:
    """Seed a stored answer under every key the replay floors will send (the replay keys'
    scheme, under each floor's own prefix), then check that each floor finds it, that the
    database floor's read is prepared, that it fails on a key it does not find and that it
    refuses a seeded key sent with another body."""
    keys = [
        (replay_key(servers[row.server], row.endpoint, number), note_body(number))
        for row in SEEDED_FLOORS
        if row.endpoint is not None
        for number in range(args.replay_keys)
    ]
    seeding = f"floors.seed({keys!r}, {AUTHORIZATION!r})"
    django(args, f"from benchmarks.benchproject import floors\n{seeding}")
    for row in SEEDED_FLOORS:
        assert row.endpoint is not None
        server = servers[row.server]
        url = server.base + row.path
        for _ in range(2 * args.workers):  # each worker, most likely
            status, headers, answer = post(
                url, replay_key(server, row.endpoint, 0), NOTE_BODY, {"Bench-Check": "1"}
            )
            if status != 201:
                raise RuntimeError(f"{row.label}: got {status} for a seeded key: {answer!r}")
            if row in (DATABASE_FLOOR, DRF_DATABASE_FLOOR) and (
                headers.get("Bench-Prepared") != "true"
            ):
                raise RuntimeError(f"{row.label}: its read is not a prepared statement")
        status, _, _ = post(url, replay_key(server, row.endpoint, args.replay_keys), NOTE_BODY)
        if status != 500:
            raise RuntimeError(f"{row.label}: got {status} for a key with no stored answer")
        status, _, _ = post(url, replay_key(server, row.endpoint, 0), note_body(1))
        if status != 422:
            raise RuntimeError(f"{row.label}: got {status} for a seeded key with another body")


@dataclass
class ColdKeys:
    """Notes keys for the cold replay rows, each sent once to a server that never saw it.

    They are created beforehand through the ``ours`` server, by wrk in request.lua's cold mode
    (the replay keys' scheme under a prefix of their own, numbered from 0; the note body names
    the key), so through the library's ordinary request path; then replayed once through
    ``ours-redis``, which makes their Redis copy. Each cold row walks them from 0, every key
    once, in every pass that sends them (the commit count's too); ``top_up`` creates more
    before a round, sized from the fastest a cold row has gone so far.
    """

    prefix: str = field(default_factory=lambda: secrets.token_hex(4))
    created: int = 0  # keys [0, created) exist
    copied: int = 0  # keys [0, copied) have their Redis copy
    sent: dict[str, int] = field(default_factory=dict)  # per cold row: the next key to send
    replay_rps: float = 2500.0  # the fastest a cold row may go, for sizing what to create
    create_rps: float = 1000.0  # guessed high until measured (``walk``)
    copy_rps: float = 3000.0
    #: How many more keys than the estimate says a row needs are created.
    MARGIN = 1.5

    def available(self, row: Row) -> int:
        return self.copied if row.server == COLD["ours-redis"] else self.created

    def top_up(self, servers: dict[str, Server], args: argparse.Namespace, seconds: float) -> None:
        """Enough keys for every cold row to run ``seconds`` at the fastest estimate."""
        need = int(self.replay_rps * seconds * self.MARGIN) + args.connections
        target = max(self.sent.values(), default=0) + need
        if self.created < target:
            self.created, self.create_rps = self.walk(
                servers["ours"], self.created, target, self.create_rps, args
            )
        if self.copied < self.created:
            copied, self.copy_rps = self.walk(
                servers["ours-redis"], self.copied, self.created, self.copy_rps, args
            )
            # A walk may run past the keys created so far: ours-redis created those, and the
            # next top-up replays them through it (which makes their copy).
            self.copied = min(copied, self.created)

    def walk(
        self, server: Server, start: int, end: int, rps: float, args: argparse.Namespace
    ) -> tuple[int, float]:
        """Send every key in [start, end) to ``server`` at least once, with one wrk thread in
        chunks of whole seconds. The last keys of a chunk may still be in flight when it ends,
        so the next chunk sends them again (a replay, or a 409 while the first is running).
        Returns the key before which every key has been sent, and the rate seen."""
        connections = max(args.connections, 8)
        row = Row("cold keys", server.variant, NOTES, "cold", "cold-keys")
        while start < end:
            # Rounded down (and the rates guessed high): the walk goes past ``end`` by less
            # than a second's keys.
            seconds = max(1, min(60, int((end - start) / rps)))
            result = wrk(server, row, args, seconds, cold=(self.prefix, start, 1, connections))
            sent, rps = result["most_per_thread"], max(result["rps"], 1.0)
            if result["socket_errors"] or result["bad_status"] > connections or sent <= connections:
                raise RuntimeError(f"{server.variant}: creating cold keys failed: {result}")
            start += sent - connections
            print(f"cold keys: {start} through {server.variant}", file=sys.stderr)
        return start, rps


@dataclass(frozen=True)
class Snapshot:
    """Counters read between rows; a row's figures are the differences over its requests."""

    app_cpu: float  # the row's server's gunicorn workers, seconds
    statements: int  # SQL statements those workers executed (benchproject/counting.py)
    postgres_cpu: dict[int, float]  # per backend serving the benchmark database, seconds


class Database:
    """Reads the benchmark database's counters, over a connection to another database.

    PostgreSQL CPU is the ``/proc`` CPU time of the backends serving the benchmark database (the
    workers' connections; the WAL writer and the checkpointer, shared with other databases, are
    left out). Commits come from ``pg_stat_database``, which a busy backend updates at most once
    a second and an idle one only 10 s after its last report, so they are counted in a pass of
    their own that waits :data:`STATS_DELAY` after each row (:func:`count_commits`).
    """

    STATS_DELAY = 10.5

    def __init__(self, database_url: str) -> None:
        self.name = database_url.rsplit("/", 1)[1]
        self.connection = psycopg.connect(
            database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True
        )
        self.bench = psycopg.connect(database_url, autocommit=True)

    def backends_cpu(self) -> dict[int, float]:
        pids = self.connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", [self.name]
        ).fetchall()
        cpu = {}
        for (pid,) in pids:
            # A backend gone, or a server in another PID namespace: no CPU to read.
            with contextlib.suppress(FileNotFoundError):
                cpu[pid] = process_cpu_seconds(pid)
        return cpu

    def notes_created(self) -> int:
        """The highest note id so far: a cold replay that creates a note was no replay."""
        row = self.bench.execute("SELECT coalesce(max(id), 0) FROM bench_notes_note").fetchone()
        return int(row[0]) if row else 0

    def versions(self) -> str:
        row = self.connection.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "unknown"

    def commits(self) -> int:
        row = self.connection.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [self.name]
        ).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.connection.close()
        self.bench.close()


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def snapshot(server: Server, database: Database, count_dir: Path) -> Snapshot:
    return Snapshot(
        app_cpu=server.cpu_seconds(),
        statements=counting.total(count_dir, server.variant),
        postgres_cpu=database.backends_cpu(),
    )


def wrk(
    server: Server,
    row: Row,
    args: argparse.Namespace,
    duration: float,
    measure: tuple[Database, Path] | None = None,
    cold: tuple[str, int, int, int] | None = None,
) -> dict[str, Any]:
    """One wrk run of ``row`` against ``server``; a cold row needs ``cold``: its keys' prefix,
    the first key to send, and wrk's threads and connections."""
    threads, connections = args.threads, args.connections
    env = {
        **os.environ,
        "BENCH_MODE": row.mode,
        "BENCH_BODY": row.endpoint.body if row.endpoint else "none",
        "BENCH_KEY_PREFIX": secrets.token_hex(4),
        "BENCH_REPLAY_KEYS": str(args.replay_keys),
        "BENCH_ACCOUNTS": str(ACCOUNTS),
        "BENCH_AUTHORIZATION": AUTHORIZATION,
    }
    if row.mode == "replay" and row.endpoint is not None:
        env["BENCH_KEY_PREFIX"] = server.replay_prefix(row.endpoint)
    if row.mode == "cold":
        assert cold is not None, "a cold row needs its keys"
        env["BENCH_KEY_PREFIX"], start, threads, connections = cold
        env["BENCH_COLD_START"], env["BENCH_THREADS"] = str(start), str(threads)
    before = snapshot(server, *measure) if measure else None
    output = subprocess.run(
        [
            "wrk", "--threads", str(threads), "--connections", str(connections),
            "--duration", f"{duration:.0f}s", "--timeout", "10s", "--script", str(LUA),
            server.base + row.path,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # fmt: skip
    line = next(line for line in output.splitlines() if line.startswith("WRK_RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("WRK_RESULT "))
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    if measure and before:
        after = snapshot(server, *measure)
        requests = max(result["requests"], 1)
        postgres_cpu = sum(
            cpu - before.postgres_cpu.get(pid, 0.0) for pid, cpu in after.postgres_cpu.items()
        )
        result["cpu_ms_per_request"] = 1000 * (after.app_cpu - before.app_cpu) / requests
        result["pg_cpu_ms_per_request"] = 1000 * postgres_cpu / requests
        result["statements_per_request"] = (after.statements - before.statements) / requests
    return result


def run_row(
    servers: dict[str, Server],
    row: Row,
    args: argparse.Namespace,
    duration: float,
    cold_keys: ColdKeys,
    database: Database,
    measure: tuple[Database, Path] | None = None,
) -> dict[str, Any]:
    """One run of ``row``; a cold row takes the next of its keys, none sent to its server
    before, and fails if it ran past the keys created or created a note (did not replay)."""
    server = servers[row.server]
    if row.mode != "cold":
        return wrk(server, row, args, duration, measure)
    start = cold_keys.sent.get(row.label, 0)
    notes = database.notes_created()
    result = wrk(
        server,
        row,
        args,
        duration,
        measure,
        (cold_keys.prefix, start, args.threads, args.connections),
    )
    cold_keys.sent[row.label] = start + result["most_per_thread"] * args.threads
    cold_keys.replay_rps = max(cold_keys.replay_rps, result["rps"])
    if cold_keys.sent[row.label] > cold_keys.available(row):
        raise RuntimeError(
            f"{row.label}: sent keys up to {cold_keys.sent[row.label]}, "
            f"only {cold_keys.available(row)} were created (ColdKeys.MARGIN too small)"
        )
    if database.notes_created() != notes:
        raise RuntimeError(f"{row.label}: created notes: not every request was a replay")
    return result


def count_commits(
    servers: dict[str, Server],
    database: Database,
    args: argparse.Namespace,
    cold_keys: ColdKeys,
) -> dict[str, float]:
    """Commits per request of each row, from ``pg_stat_database``, one row at a time.

    Each row runs alone for ``--commit-seconds``, then the backends are left idle until they have
    reported their counts; the benchmark database sees nothing else meanwhile.
    """
    cold_keys.top_up(servers, args, args.commit_seconds)
    time.sleep(Database.STATS_DELAY)
    commits = {}
    for row in ROWS:
        before = database.commits()
        result = run_row(servers, row, args, args.commit_seconds, cold_keys, database)
        time.sleep(Database.STATS_DELAY)
        commits[row.label] = (database.commits() - before) / max(result["requests"], 1)
        print(f"commits: {row.label}: {commits[row.label]:.2f}/request", file=sys.stderr)
    return commits


def host(database: Database, redis_url: str) -> dict[str, Any]:
    """What the run ran on (the load averages are added around the run)."""
    import redis

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    with redis.Redis.from_url(redis_url) as client:
        redis_version = str(client.info("server").get("redis_version", "unknown"))
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "postgresql": database.versions(),
        "redis": redis_version,
    }


def summarise(
    results: dict[str, list[dict[str, Any]]], commits: dict[str, float]
) -> list[dict[str, Any]]:
    """Medians per row; ratios to the same endpoint's plain row, replays also to the ceiling."""

    def median(row: Row, name: str) -> float:
        return float(statistics.median(result[name] for result in results[row.label]))

    plain = {row.endpoint: row for row in ROWS if row.mode == "none"}
    ceiling_rps = median(CEILING, "rps")
    summary = []
    for row in ROWS:
        base = plain.get(row.baseline or row.endpoint, plain[PAYMENTS])
        cpu = median(row, "cpu_ms_per_request") + median(row, "pg_cpu_ms_per_request")
        base_cpu = median(base, "cpu_ms_per_request") + median(base, "pg_cpu_ms_per_request")
        summary.append(
            {
                "row": row.label,
                "group": row.group,
                "endpoint": row.endpoint.name if row.endpoint else None,
                "rps": median(row, "rps"),
                "ratio": median(row, "rps") / median(base, "rps"),
                "ceiling_ratio": median(row, "rps") / ceiling_rps,
                "p50_ms": median(row, "p50_us") / 1000,
                "p99_ms": median(row, "p99_us") / 1000,
                "p99_added_ms": (median(row, "p99_us") - median(base, "p99_us")) / 1000,
                "cpu_ms": median(row, "cpu_ms_per_request"),
                "pg_cpu_ms": median(row, "pg_cpu_ms_per_request"),
                "cpu_ratio": cpu / base_cpu if base_cpu else float("nan"),
                "statements": median(row, "statements_per_request"),
                "commits": commits.get(row.label),
            }
        )
    return summary


def against_floors(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each of our notes rows over each of its floors, round by round (the two measured seconds
    apart, ``measuring_order``), and the median of those ratios: steadier than the ratio of
    the two rows' medians, which may come from different rounds."""
    compared = []
    for label, floors in AGAINST_FLOORS.items():
        for floor in floors:
            rounds = [
                ours["rps"] / base["rps"]
                for ours, base in zip(results[label], results[floor.label], strict=True)
                if base["rps"]
            ]
            if rounds:
                compared.append(
                    {
                        "row": label,
                        "floor": floor.label,
                        "rounds": rounds,
                        "median": statistics.median(rounds),
                    }
                )
    return compared


def floors_table(compared: list[dict[str, Any]]) -> str:
    lines = [
        "| our row | floor | ours / floor, median of rounds | rounds |",
        "|---|---|---:|---|",
    ]
    for item in compared:
        rounds = ", ".join(f"{ratio:.2f}" for ratio in item["rounds"])
        floor = item["floor"].removeprefix("floor: ")
        lines.append(f"| {item['row']} | {floor} | {item['median']:.2f} | {rounds} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """One line of the verdict: ``row`` over ``against`` (a row, or the best of several peers'
    in each round), per round; the median of the rounds, or their worst (``every_round``),
    must reach ``target`` (``at_most``: must stay under it, for CPU)."""

    row: str
    against: tuple[str, ...]
    target: float
    every_round: bool = False
    cpu: bool = False  # app + PostgreSQL CPU per request instead of requests/s
    at_most: bool = False


def peers(what: str, storage: str, *names: str) -> tuple[str, ...]:
    """The notes rows of the peers (by package name) that keep keys in ``storage``."""
    return tuple(
        f"notes: {name}, {what}, {storage}"
        for name, _, kept_in in GUARDS
        if kept_in == storage and not name.startswith("ours") and (not names or name in names)
    )


#: The targets of issue 40, on the notes endpoint (the lightest create: the layer's own cost
#: is the largest share there).
TARGETS = [
    Target("notes: ours, replays, database", (DATABASE_FLOOR.label,), 0.95),
    Target("notes: ours, replays, database, cold", (DATABASE_FLOOR.label,), 0.85),
    Target("notes: ours, replays, Redis", (REDIS_FLOOR.label,), 0.90),
    Target("notes: ours, middleware, replays, Redis", (REDIS_FLOOR.label,), 0.90),
    Target("notes: ours, first-time, database", (FIRST_TIME_FLOOR.label,), 0.95),
    Target("notes: ours, first-time, Redis", (FIRST_TIME_REDIS_FLOOR.label,), 0.95),
    Target("notes: ours, middleware, first-time, Redis", (FIRST_TIME_REDIS_FLOOR.label,), 0.95),
    Target("notes: ours, replays, kept in memory (database behind)", (CEILING.label,), 0.80),
    Target("notes: ours, replays, database", peers("replays", "database"), 1.05, True),
    Target("notes: ours, replays, database, cold", peers("replays", "database"), 1.05, True),
    Target("notes: ours, replays, Redis", peers("replays", "Redis"), 1.05, True),
    Target("notes: ours, middleware, replays, Redis", peers("replays", "Redis"), 1.05, True),
    Target("notes: ours, first-time, database", peers("first-time", "database"), 1.05, True),
    Target(
        "notes: ours, first-time, Redis",
        peers("first-time", "Redis", "drf-idempotency"),
        0.95,
        True,
    ),
    Target(
        "notes: ours, middleware, first-time, Redis",
        peers("first-time", "Redis", "drf-idempotency"),
        0.95,
        True,
    ),
    Target(
        "notes: ours, first-time, database",
        (FIRST_TIME_FLOOR.label,),
        1.10,
        cpu=True,
        at_most=True,
    ),
]
_LABELS = {row.label for row in ROWS}
if not all({t.row, *t.against} <= _LABELS for t in TARGETS):  # a renamed row, caught at import
    raise RuntimeError("TARGETS name rows that do not exist")


def verdict(
    results: dict[str, list[dict[str, Any]]], targets: list[Target] = TARGETS
) -> list[dict[str, Any]]:
    """Each target's ratio, round by round (a round measures a row and its floor seconds
    apart: ``measuring_order``), and whether it is met: a dict per target with ``row``,
    ``against``, ``rounds``, ``ratio`` (the median of the rounds, or their worst where every
    round must pass), ``target`` and ``passed``."""

    def value(result: dict[str, Any], cpu: bool) -> float:
        if cpu:
            return float(result["cpu_ms_per_request"] + result["pg_cpu_ms_per_request"])
        return float(result["rps"])

    lines = []
    for target in targets:
        rounds = []
        for number, ours in enumerate(results.get(target.row, [])):
            others = [
                value(results[label][number], target.cpu)
                for label in target.against
                if number < len(results.get(label, []))
            ]
            best = (min if target.cpu else max)(others, default=0.0)
            if best:
                rounds.append(value(ours, target.cpu) / best)
        if not rounds:
            ratio = float("nan")
        elif target.every_round:
            ratio = max(rounds) if target.at_most else min(rounds)
        else:
            ratio = statistics.median(rounds)
        passed = ratio <= target.target if target.at_most else ratio >= target.target
        if len(target.against) == 1:
            against = target.against[0]
        else:  # "notes: drf-idempotency, replays, database" -> "drf-idempotency"
            names = (label.split(": ", 1)[-1].split(",")[0] for label in target.against)
            against = "best of " + ", ".join(names)
        lines.append(
            {
                "row": target.row,
                "against": against,
                "measure": "CPU per request" if target.cpu else "requests/s",
                "rounds": rounds,
                "ratio": ratio,
                "target": target.target,
                "at_most": target.at_most,
                "every_round": target.every_round,
                "passed": bool(rounds) and passed,
            }
        )
    return lines


def verdict_table(lines: list[dict[str, Any]]) -> str:
    table = [
        "| row | against | measure | ours ÷ it | rounds | target | verdict |",
        "|---|---|---|---:|---|---|---|",
    ]
    for line in lines:
        rounds = ", ".join(f"{ratio:.2f}" for ratio in line["rounds"])
        target = f"{'≤' if line['at_most'] else '≥'} {line['target']:.2f}"
        target += ", every round" if line["every_round"] else ""
        table.append(
            f"| {line['row']} | {line['against'].removeprefix('floor: ')} | {line['measure']} "
            f"| {line['ratio']:.2f} | {rounds} | {target} "
            f"| {'PASS' if line['passed'] else 'FAIL'} |"
        )
    passed = sum(line["passed"] for line in lines)
    table += ["", f"verdict: {passed} of {len(lines)} targets met, {len(lines) - passed} missed"]
    return "\n".join(table)


def table(summary: list[dict[str, Any]], duplicates: dict[str, int]) -> str:
    lines = [
        "| row | req/s | × plain | × ceiling | p50 ms | p99 ms | p99 added ms | app CPU ms/req "
        "| PG CPU ms/req | × plain CPU | SQL/req | commits/req |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for item in summary:
        against_ceiling = item["group"].startswith("replay") or item["group"] in AGAINST_CEILING
        ceiling = f"{item['ceiling_ratio']:.2f}" if against_ceiling else ""
        baseline = item["group"] in BASELINES
        added = "" if baseline else f"{item['p99_added_ms']:+.1f}"
        lines.append(
            f"| {item['row']} | {item['rps']:.0f} | {item['ratio']:.2f} | {ceiling} "
            f"| {item['p50_ms']:.1f} | {item['p99_ms']:.1f} | {added} | {item['cpu_ms']:.2f} "
            f"| {item['pg_cpu_ms']:.2f} | {item['cpu_ratio']:.2f} | {item['statements']:.1f} "
            f"| {'–' if item['commits'] is None else format(item['commits'], '.2f')} |"
        )
    lines += ["", "Payments created by 8 concurrent requests with one new key (1 is correct):", ""]
    lines += [f"- {variant}: {count}" for variant, count in duplicates.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per row and round")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers per server")
    parser.add_argument("--replay-keys", type=int, default=100)
    parser.add_argument(
        "--commit-seconds", type=float, default=2.0, help="seconds per row of the commit count"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a few requests per row; fail on errors"
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/idem_speed_bench"
        ),
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/2")
    )
    parser.add_argument("--output", type=Path, default=ROOT / "artifacts" / "bench.json")
    parser.add_argument(
        "--results",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "http.json",
        help="where a full run (not --smoke) writes its report too, for the repository",
    )
    parser.add_argument("--no-results", action="store_true", help="do not write --results")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.duration, args.connections, args.replay_keys = 1, 1.0, 2, 5
    if shutil.which("wrk") is None:
        print("wrk is not installed: apt-get install -y wrk", file=sys.stderr)
        return 2

    create_database(args)
    prepare_database(args)
    count_dir = Path(tempfile.mkdtemp(prefix="bench-statements-"))
    os.environ["BENCH_COUNT_DIR"] = str(count_dir)
    database = Database(args.database_url)
    servers = {variant: Server(variant, 8301 + index) for index, variant in enumerate(VARIANTS)}
    cold_keys = ColdKeys()
    machine = host(database, args.redis_url)
    load_before = os.getloadavg()
    try:
        for server in servers.values():
            start(server, args)
        for server in servers.values():
            wait_until_up(server)
            print(f"{server.variant}: up; creating replay keys", file=sys.stderr)
            cold = server.variant in COLD.values()  # its replay keys only warm it up
            for endpoint in (NOTES,) if cold else (PAYMENTS, NOTES):
                create_replay_keys(server, endpoint, args.replay_keys)
        for variant in ("ours", "ours-middleware"):
            # The replay rows must replay: a key sent under another scope would run again.
            server = servers[variant]
            smoke_replay = post(server.base + PAYMENTS.guarded, replay_key(server, PAYMENTS, 0))
            if smoke_replay[1].get("Idempotent-Replay") != "true":
                raise RuntimeError(f"{variant}: our replay was not a replay: {smoke_replay}")
        prepare_floors(servers, args)
        duplicates = {}
        for variant, server in servers.items():
            if variant not in COLD.values():
                print(f"{variant}: concurrent duplicates", file=sys.stderr)
                duplicates[variant] = duplicates_let_through(server)
        if not args.smoke:  # warm every server and the database caches
            warm = {}
            for row in ROWS:
                # A cold server is warmed up on its own replay keys: it must not see cold ones.
                warming = replace(row, mode="replay") if row.mode == "cold" else row
                warm[row.label] = wrk(servers[row.server], warming, args, 2.0)["rps"]
            cold_keys.create_rps = warm["notes: ours, first-time, database"]
            cold_keys.copy_rps = warm["notes: ours, replays, Redis"]
            cold_keys.replay_rps = max(warm[row.label] for row in ROWS if row.mode == "cold")
        results: dict[str, list[dict[str, Any]]] = {row.label: [] for row in ROWS}
        for round_number in range(args.rounds):
            cold_keys.top_up(servers, args, args.duration)
            # Rotate the order each round, so no row always runs first or last.
            order = measuring_order()
            shift = round_number % len(order)
            for row in order[shift:] + order[:shift]:
                result = run_row(
                    servers, row, args, args.duration, cold_keys, database, (database, count_dir)
                )
                results[row.label].append(result)
                print(f"round {round_number + 1}/{args.rounds}: {row.label}: "
                      f"{result['rps']:.0f} req/s", file=sys.stderr)  # fmt: skip
        commits = {} if args.smoke else count_commits(servers, database, args, cold_keys)
    finally:
        for server in servers.values():
            stop(server)
        database.close()
        shutil.rmtree(count_dir, ignore_errors=True)
    machine |= {"load_average_before": load_before, "load_average_after": os.getloadavg()}
    summary = summarise(results, commits)
    compared = against_floors(results)
    verdicts = verdict(results)
    report = {
        "host": machine,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "results")}
        | {"body": BODY, "note_body": NOTE_BODY, "cold_keys_created": cold_keys.created},
        "verdict": verdicts,
        "summary": summary,
        "against_floors": compared,
        "duplicates": duplicates,
        "raw": results,
    }
    written = [args.output]
    if not (args.smoke or args.no_results):
        written.append(args.results)
    for path in written:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))
    print(table(summary, duplicates))
    print("\nOur rows against their floors, each round's pair measured seconds apart:\n")
    print(floors_table(compared))
    print(
        "\nVerdict (issue 40's targets, notes endpoint; each ratio per round, then its median or,"
    )
    print("where every round must pass, its worst):\n")
    print(verdict_table(verdicts))
    print(f"\nhost: {machine}; raw results in {', '.join(map(str, written))}")
    if args.smoke:
        failed = [
            label
            for label, runs in results.items()
            if any(r["requests"] == 0 or r["bad_status"] or r["socket_errors"] for r in runs)
        ]
        if failed:
            print(f"smoke run failed for: {failed}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
