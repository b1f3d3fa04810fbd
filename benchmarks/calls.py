"""Per-request profile: Python calls and CPU of each path, in process, through the whole stack.

The lightest create endpoint of the HTTP benchmark (``benchproject/notes``) is called through
Django's WSGI handler, in one process, on PostgreSQL: the plain create, a first-time key, a
replay, a cold replay (a completed key this process has not answered: ours, database only), the
bare GET (the ceiling) and the bare POST (a replay's request answered by a view that
does nothing; ours only), for ours on the database, with the Redis copy and with answers kept in
memory, and for the peers; and once the floors (``benchproject.views``: what any layer must do
at the least, with no layer's code). Per path it prints the Python function calls per request
(``cProfile``; a count, so the same on a busy machine as on an idle one) and the thread CPU per
request. The calls are what a change to the request path is judged by between two runs of
``make bench``; the HTTP rows say what they are worth.

Each variant runs in a fresh subprocess (Django's settings are per process).

    python -m benchmarks.calls [--requests 300] [--smoke] [--dump first]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.run import AUTHORIZATION, note_body

ROOT = Path(__file__).resolve().parent.parent
DATABASE_URL = os.environ.get(
    "BENCH_CALLS_URL", "postgres://postgres@127.0.0.1:5432/idem_speed_calls"
)
#: Variant (``benchproject/settings.py``) -> what the table calls it.
VARIANTS = {
    "ours": "ours, database",
    "ours-redis": "ours, Redis",
    "ours-memory": "ours, kept in memory",
    "ours-middleware": "ours, middleware, Redis",
    "drfi-db": "drf-idempotency, database",
    "drfi-redis": "drf-idempotency, Redis",
    "dik": "django-idempotency-key, Redis",
}
PATHS = ("plain", "first", "replay", "cold", "get", "post")
#: The floors (``benchproject.views``): what any layer must do at the least, with no layer's
#: code; the same for every variant, so counted in the database variant's process only.
FLOOR_PATHS = (
    "floor-redis", "floor-database", "floor-first", "floor-first-redis", "floor-drf-redis",
    "floor-drf-database",
)  # fmt: skip
#: Paths a variant cannot serve: django-idempotency-key's middleware refuses any POST without a
#: key, the plain create included. The bare POST (a replay's request answered by a view that does
#: nothing) is ours alone: the peers' middleware would guard it.
SKIPPED = {("dik", "plain"), ("dik", "post"), ("drfi-db", "post"), ("drfi-redis", "post")} | {
    (variant, path) for variant in VARIANTS if variant != "ours" for path in (*FLOOR_PATHS, "cold")
}
NOTE = note_body(0).encode()
#: Distinct keys the replay path cycles over, each completed before the count.
REPLAY_KEYS = 50


def environ(
    method: str,
    path: str,
    body: bytes = b"",
    key: str | None = None,
    authorization: str | None = None,
) -> dict[str, Any]:
    """A WSGI environ as gunicorn would build it for wrk's request."""
    request: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "127.0.0.1:8000",
        "HTTP_ACCEPT": "*/*",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
    }
    if key is not None:
        request["HTTP_IDEMPOTENCY_KEY"] = key
    if authorization is not None:
        request["HTTP_AUTHORIZATION"] = authorization
    return request


def child(variant: str, requests: int, dump: str | None) -> None:
    """Runs in the subprocess: set Django up for ``variant`` and print the measurements."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.handlers.wsgi import WSGIHandler

    get_user_model().objects.get_or_create(username="bench")
    app = WSGIHandler()

    def call(request: dict[str, Any]) -> str:
        statuses: list[str] = []
        chunks = app(request, lambda status, headers, *rest: statuses.append(status))
        b"".join(chunks)
        chunks.close()
        return statuses[0]

    prefix = uuid.uuid4().hex[:8]
    replay_keys = [f"r-{prefix}-{number}" for number in range(REPLAY_KEYS)]
    counter = iter(range(REPLAY_KEYS, 10**9))  # each key a body of its own, as in the HTTP rows
    if variant == "ours":  # the replay floors fail on a key with no stored answer
        from benchmarks.benchproject import floors

        floors.seed(
            [(key, note_body(number)) for number, key in enumerate(replay_keys)], AUTHORIZATION
        )

    def guarded(number: int, key: str) -> dict[str, Any]:
        body = note_body(number).encode()
        return environ("POST", "/api/v1/notes/", body, key, AUTHORIZATION)

    def first() -> dict[str, Any]:
        number = next(counter)
        return guarded(number, f"f-{prefix}-{number}")

    def replay() -> dict[str, Any]:
        number = next(counter) % REPLAY_KEYS
        return guarded(number, replay_keys[number])

    cold_keys = iter(range(10**9))

    def cold() -> dict[str, Any]:
        number = next(cold_keys)
        return guarded(number, f"k-{prefix}-{number}")

    def floor(path: str, key: str) -> dict[str, Any]:
        return environ("POST", path, NOTE, key, AUTHORIZATION)

    makers: dict[str, Callable[[], dict[str, Any]]] = {
        "plain": lambda: environ("POST", "/plain/notes/", NOTE, None, AUTHORIZATION),
        "first": first,
        "replay": replay,
        "cold": cold,
        "get": lambda: environ("GET", "/get/"),
        "post": lambda: floor("/post/", replay_keys[0]),
        "floor-redis": lambda: floor("/floor/redis/", replay_keys[0]),
        "floor-database": lambda: floor("/floor/database/", replay_keys[0]),
        "floor-drf-redis": lambda: floor("/floor/drf/redis/", replay_keys[0]),
        "floor-drf-database": lambda: floor("/floor/drf/database/", replay_keys[0]),
        "floor-first": lambda: floor("/floor/notes/", f"c-{prefix}-{next(counter)}"),
        "floor-first-redis": lambda: floor("/floor/notes/redis/", f"c-{prefix}-{next(counter)}"),
    }
    expected = dict.fromkeys(("plain", "first", "replay", "cold", "post"), "201") | {"get": "200"}
    expected |= dict.fromkeys(FLOOR_PATHS, "201")
    for number, key in enumerate(replay_keys):
        for _ in range(2):  # completed, then replayed once (which copies it to Redis)
            call(guarded(number, key))
    results: dict[str, Any] = {}
    for path, make in makers.items():
        if (variant, path) in SKIPPED:
            continue
        if path == "cold":  # completed here, then forgotten: as if another process had
            for number in range(30 + 2 * requests):
                call(guarded(number, f"k-{prefix}-{number}"))
            from django_idempotency.request import fingerprint, memory

            memory.clear()  # the read-first hint
            fingerprint._SEEN.clear()  # the fingerprint of a body seen before
        for _ in range(30):  # warm: connections, prepared statements, caches
            call(make())
        timed = [make() for _ in range(requests)]
        started = time.thread_time()
        statuses = {call(request) for request in timed}
        cpu_ms = (time.thread_time() - started) / requests * 1000
        profiled = [make() for _ in range(requests)]
        profile = cProfile.Profile()
        profile.enable()
        for request in profiled:
            call(request)
        profile.disable()
        stats = pstats.Stats(profile)
        results[path] = {
            "calls": stats.total_calls / requests,  # type: ignore[attr-defined]
            "cpu_ms": cpu_ms,
            "ok": all(status.startswith(expected[path]) for status in statuses),
            "statuses": sorted(statuses),
        }
        if saved := os.environ.get("CALLS_SAVE"):  # a directory: every path's profile, to diff
            stats.dump_stats(Path(saved) / f"{variant}-{path}.prof")
        if dump == path:
            # CALLS_SORT: pstats' order ("ncalls", ...); CALLS_ONLY: a regular expression the
            # lines must match; CALLS_CALLERS: whose callers to print.
            stats.sort_stats(os.environ.get("CALLS_SORT", "cumulative"))
            stats.print_stats(*filter(None, [os.environ.get("CALLS_ONLY"), 60]))
            if callers := os.environ.get("CALLS_CALLERS"):
                stats.print_callers(callers)
    print("CALLS_RESULT " + json.dumps({"variant": variant, **results}))


def run_variant(variant: str, requests: int, dump: str | None) -> dict[str, Any] | None:
    env = {
        **os.environ,
        "BENCH_VARIANT": variant,
        "BENCH_DATABASE_URL": DATABASE_URL,
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "benchmarks.calls", "--child", variant]
    command += ["--requests", str(requests)] + (["--dump", dump] if dump else [])
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    for line in completed.stdout.splitlines():
        if line.startswith("CALLS_RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("CALLS_RESULT "))
            return result
        if dump:
            print(line)
    print(f"{variant}: failed\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}")
    return None


def migrate() -> None:
    """Create the database if needed and migrate every variant's apps."""
    import psycopg

    name = DATABASE_URL.rsplit("/", 1)[1]
    with psycopg.connect(DATABASE_URL.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    env = {
        **os.environ,
        "BENCH_VARIANT": "all",
        "BENCH_DATABASE_URL": DATABASE_URL,
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"]
    subprocess.run(command, cwd=ROOT, env=env, check=True)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | plain create | first-time | replay | cold replay | bare GET | bare POST "
        "| first-time CPU ms (plain) | replay CPU ms (GET, POST) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:

        def cell(path: str, what: str, form: str, result: dict[str, Any] = result) -> str:
            return format(result[path][what], form) if path in result else "–"

        lines.append(
            f"| {VARIANTS[result['variant']]} | "
            + " | ".join(cell(path, "calls", ",.0f") for path in PATHS)
            + f" | {cell('first', 'cpu_ms', '.2f')} ({cell('plain', 'cpu_ms', '.2f')})"
            + f" | {cell('replay', 'cpu_ms', '.2f')} ({cell('get', 'cpu_ms', '.2f')}, "
            + f"{cell('post', 'cpu_ms', '.2f')}) |"
        )
    floors = next((result for result in results if "floor-first" in result), None)
    if floors is not None:
        lines += [
            "",
            "Floors, what any layer must do at the least with no layer's code (calls, CPU ms):",
            "",
            "| Redis floor: bare POST + one GET | database floor: bare POST + one SELECT "
            "| first-time floor: plain create + claim + completion "
            "| first-time floor + one Redis GET (miss) "
            "| DRF Redis floor: DRF authentication + one GET "
            "| DRF database floor: DRF authentication + one SELECT |",
            "|---:|---:|---:|---:|---:|---:|",
            "| "
            + " | ".join(
                f"{floors[path]['calls']:,.0f} ({floors[path]['cpu_ms']:.2f})"
                for path in FLOOR_PATHS
            )
            + " |",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="a few requests; fail on errors")
    parser.add_argument("--dump", choices=PATHS + FLOOR_PATHS, help="print this path's profile")
    parser.add_argument("--variant", choices=list(VARIANTS), action="append")
    parser.add_argument("--output", type=Path, default=ROOT / "artifacts" / "calls.json")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.requests = 5
    if args.child:
        child(args.child, args.requests, args.dump)
        return 0
    migrate()
    results = [
        result
        for variant in args.variant or list(VARIANTS)
        if (result := run_variant(variant, args.requests, args.dump)) is not None
    ]
    print("Python calls per request, lightest create endpoint, in process (PostgreSQL):")
    print(table(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    failed = [
        r["variant"] for r in results if not all(r[p]["ok"] for p in PATHS + FLOOR_PATHS if p in r)
    ]
    if failed or len(results) < len(args.variant or VARIANTS):
        print(f"failed or answered unexpectedly: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
