"""Attached duplicates' latency: how long after the first request's answer a duplicate that
waits for it (``Prefer: wait``) gets its own, on PostgreSQL, with real threads.

Each round holds a first request inside its view, sends a duplicate with ``Prefer: wait=5``
from another thread, lets the first go once the duplicate waits, and measures from the moment
the first request's ``serve`` returned to the moment the duplicate's did. Two ways to be woken:

* same process: the completion wakes the waiter directly (``attach.notify``);
* other process: the in-process wake is turned off, so only the shared poller (one statement
  per ``ATTACH_POLL_SECONDS`` tick for every waiter) sees the completion, as it would for a
  first request served by another worker.

Prints p50 and p99 in milliseconds (target: p50 < 20 ms). Runs in a subprocess on its own kept
database (``…_attach``), like ``benchmarks.micro``.

    python -m benchmarks.attach_latency [--rounds 200] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/idem_speed_attach"


def one_round(factory: Any, options: Any) -> float:
    """One first request held in its view and one duplicate that waits for it: milliseconds
    from the first's answer to the duplicate's."""
    from django.db import connection
    from django.http import HttpResponse

    from django_idempotency.request import attach, lifecycle

    key = f"attach-{uuid.uuid4()}"
    started, gate = threading.Event(), threading.Event()
    done: dict[str, float] = {}

    def view() -> HttpResponse:
        started.set()
        gate.wait(10)
        return HttpResponse(b'{"id": 1}', status=201, content_type="application/json")

    def serve(name: str, prefer: str | None) -> None:
        headers = {"HTTP_IDEMPOTENCY_KEY": key}
        if prefer:
            headers["HTTP_PREFER"] = prefer
        request = factory.post("/bench/", b"{}", "application/json", **headers)
        try:
            response = lifecycle.serve(
                request, view, options, scope=lambda: "bench", fingerprint=lambda: "f" * 64
            )
            done[name] = time.perf_counter()
            assert response.status_code == 201, response.content
            if name == "waiter":
                assert response["Idempotent-Replay"] == "true"
        finally:
            connection.close()

    first = threading.Thread(target=serve, args=("first", None))
    first.start()
    started.wait(10)
    waiter = threading.Thread(target=serve, args=("waiter", "wait=5"))
    waiter.start()
    deadline = time.monotonic() + 10
    while attach.waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.0005)
    gate.set()
    first.join(20)
    waiter.join(20)
    return (done["waiter"] - done["first"]) * 1000


def measure(rounds: int, *, in_process: bool) -> list[float]:
    from django.test import RequestFactory

    from django_idempotency.request import attach, lifecycle

    factory, options = RequestFactory(), lifecycle.Options()
    notify = attach.notify
    if not in_process:
        attach.notify = lambda *args: None  # type: ignore[assignment]
    try:
        return [one_round(factory, options) for _ in range(rounds)]
    finally:
        attach.notify = notify  # type: ignore[assignment]


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "rounds": len(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


def child(rounds: int) -> None:
    import django
    from django.test.utils import setup_test_environment

    django.setup()
    setup_test_environment()
    from django.db import connection

    connection.creation.create_test_db(verbosity=0, keepdb=True)
    from django_idempotency.models import IdempotencyRecord

    IdempotencyRecord.objects.all().delete()
    connection.close()
    results = {
        "same_process": summary(measure(rounds, in_process=True)),
        "other_process": summary(measure(rounds, in_process=False)),
    }
    IdempotencyRecord.objects.all().delete()
    print("ATTACH_RESULT " + json.dumps(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="a few rounds; fail on any error")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = 5 if args.smoke else args.rounds
    if args.child:
        child(rounds)
        return 0
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
        "BENCH_VARIANT": "ours",
        "BENCH_DATABASE_URL": os.environ.get("BENCH_POSTGRES_URL", DEFAULT_URL),
        "PYTHONPATH": str(ROOT),
    }
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.attach_latency", "--child", "--rounds", str(rounds)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for line in completed.stdout.splitlines():
        if line.startswith("ATTACH_RESULT "):
            results: dict[str, Any] = json.loads(line.removeprefix("ATTACH_RESULT "))
            break
    else:
        print(completed.stderr, file=sys.stderr)
        return 1
    print("\nAttached duplicates on PostgreSQL: from the first request's answer to the waiter's")
    print("| woken by | rounds | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for name, label in (("same_process", "the completion (same process)"),
                        ("other_process", "the shared poller (other process)")):  # fmt: skip
        row = results[name]
        print(f"| {label} | {row['rounds']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
