"""In-process microbenchmark: microseconds the lifecycle adds to a request, per database backend.

For each backend (SQLite always; PostgreSQL and MariaDB when their URL answers) and with and
without the Redis copy, it times in one process, interleaved:

* baseline: the same trivial view inside ``transaction.atomic`` (what a plain write view pays);
* claim + complete: ``lifecycle.claim`` with a new key, then ``lifecycle.run`` storing it;
* replay: ``lifecycle.claim`` of a completed key and rebuilding the response;
* inbox, first delivery: ``consume_once`` of a new message id around an empty handler;
* inbox, duplicate: ``consume_once`` of a message id already handled.

and reports p50 and mean microseconds added over the baseline. Each backend runs in a fresh
subprocess, since Django's settings are per process.

    python -m benchmarks.micro [--iterations 1000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = {
    "sqlite": None,
    "postgresql": ("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/idem_speed_micro"),
    "mariadb": ("BENCH_MARIADB_URL", "mysql://root@127.0.0.1:3306/idem_speed_micro"),
}


def measure(iterations: int, use_redis: bool) -> dict[str, Any]:
    from django.conf import settings
    from django.db import transaction
    from django.http import HttpResponse
    from django.test import override_settings

    from django_idempotency.core import types
    from django_idempotency.inbox import consume_once
    from django_idempotency.request import lifecycle

    def view() -> HttpResponse:
        return HttpResponse(b'{"id": 1}', status=201, content_type="application/json")

    def identity(key: str) -> types.Identity:
        return types.Identity("user:1", key, "f" * 64, "POST", "/api/v1/payments/")

    timings: dict[str, list[float]] = {
        "baseline": [],
        "claim_complete": [],
        "replay": [],
        "consume_first": [],
        "consume_duplicate": [],
    }
    cpu: dict[str, list[float]] = {name: [] for name in timings}
    clock = time.thread_time_ns  # CPU of this thread: steadier than wall time on a busy machine
    replay_key = f"replay-{uuid.uuid4()}"
    alias = "redis" if use_redis else None
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "CACHE_ALIAS": alias}):
        first = lifecycle.claim(identity(replay_key))
        assert isinstance(first, types.Proceed)
        lifecycle.run(first.lease, view)
        handled = f"message-{uuid.uuid4()}"
        with consume_once("bench", handled):
            pass
        for _ in range(iterations):
            start, start_cpu = time.perf_counter_ns(), clock()
            with transaction.atomic():
                view()
            timings["baseline"].append(time.perf_counter_ns() - start)
            cpu["baseline"].append(clock() - start_cpu)

            start, start_cpu = time.perf_counter_ns(), clock()
            decision = lifecycle.claim(identity(str(uuid.uuid4())))
            assert isinstance(decision, types.Proceed)
            lifecycle.run(decision.lease, view)
            timings["claim_complete"].append(time.perf_counter_ns() - start)
            cpu["claim_complete"].append(clock() - start_cpu)

            start, start_cpu = time.perf_counter_ns(), clock()
            replay = lifecycle.claim(identity(replay_key))
            assert isinstance(replay, types.Replay)
            lifecycle.replay(replay.response)
            timings["replay"].append(time.perf_counter_ns() - start)
            cpu["replay"].append(clock() - start_cpu)

            start, start_cpu = time.perf_counter_ns(), clock()
            with consume_once("bench", str(uuid.uuid4())) as consumption:
                assert consumption
            timings["consume_first"].append(time.perf_counter_ns() - start)
            cpu["consume_first"].append(clock() - start_cpu)

            start, start_cpu = time.perf_counter_ns(), clock()
            with consume_once("bench", handled) as consumption:
                assert not consumption
            timings["consume_duplicate"].append(time.perf_counter_ns() - start)
            cpu["consume_duplicate"].append(clock() - start_cpu)
    base = statistics.median(timings["baseline"]) / 1000
    base_mean = statistics.fmean(timings["baseline"]) / 1000
    base_cpu = statistics.median(cpu["baseline"]) / 1000
    return {
        name: {
            "p50_us": statistics.median(values) / 1000 - (0 if name == "baseline" else base),
            "mean_us": statistics.fmean(values) / 1000 - (0 if name == "baseline" else base_mean),
            "cpu_p50_us": statistics.median(cpu[name]) / 1000
            - (0 if name == "baseline" else base_cpu),
        }
        for name, values in timings.items()
    }


def child(backend: str, iterations: int) -> None:
    """Runs in the subprocess: set Django up on ``backend`` and print the measurements."""
    import django
    from django.conf import settings
    from django.test.utils import setup_test_environment

    django.setup()
    setup_test_environment()
    from django.db import connection

    # keepdb: a fresh, migrated database of our own (…_micro), kept between runs.
    connection.creation.create_test_db(verbosity=0, keepdb=True)
    from django_idempotency.models import IdempotencyRecord, ProcessedMessage

    IdempotencyRecord.objects.all().delete()
    ProcessedMessage.objects.all().delete()
    results = {"no_redis": measure(iterations, use_redis=False)}
    if settings.CACHES["redis"]["LOCATION"]:
        results["redis"] = measure(iterations, use_redis=True)
    IdempotencyRecord.objects.all().delete()
    ProcessedMessage.objects.all().delete()
    print("MICRO_RESULT " + json.dumps({"backend": backend, **results}))


def run_backend(backend: str, iterations: int) -> dict[str, Any] | None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
        "BENCH_VARIANT": "ours",
        "PYTHONPATH": str(ROOT),
    }
    source = BACKENDS[backend]
    if source is None:
        env["BENCH_DATABASE_URL"] = "sqlite:////tmp/idem_speed_micro.sqlite3"
    else:
        env["BENCH_DATABASE_URL"] = os.environ.get(source[0], source[1])
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.micro", "--child", backend, "--iterations",
         str(iterations)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )  # fmt: skip
    for line in completed.stdout.splitlines():
        if line.startswith("MICRO_RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("MICRO_RESULT "))
            return result
    print(f"{backend}: skipped ({completed.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
    return None


def cell(timing: dict[str, float]) -> str:
    return f"{timing['p50_us']:.0f} ({timing['mean_us']:.0f}) | {timing['cpu_p50_us']:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", choices=list(BACKENDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.iterations)
        return 0
    iterations = 20 if args.smoke else args.iterations
    rows = [result for backend in BACKENDS if (result := run_backend(backend, iterations))]
    print(
        "| backend | Redis | baseline µs | claim + complete: +µs wall p50 (mean) | +µs CPU p50 "
        "| replay: +µs wall p50 (mean) | +µs CPU p50 "
        "| inbox first delivery: +µs wall p50 (mean) | +µs CPU p50 "
        "| inbox duplicate: +µs wall p50 (mean) | +µs CPU p50 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in rows:
        for mode in ("no_redis", "redis"):
            if mode not in result:
                continue
            timing = result[mode]
            print(
                f"| {result['backend']} | {'yes' if mode == 'redis' else 'no'} "
                f"| {timing['baseline']['p50_us']:.0f} "
                f"| {cell(timing['claim_complete'])} | {cell(timing['replay'])} "
                f"| {cell(timing['consume_first'])} | {cell(timing['consume_duplicate'])} |"
            )
    out = ROOT / "artifacts" / ("micro-smoke.json" if args.smoke else "micro.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
