"""Would a Bloom filter in front of the key store save work? The work it could remove, measured.

A filter answers "certainly never seen" or "maybe seen". What that could skip, path by path:

* first-time key, database only: nothing. The claim is one statement that both looks and
  inserts; the insert is the lease, so a key known to be new still needs it.
* first-time key with Redis: the ``GET`` that misses before the claim (``redis_copy.lookup``).
* consumer deduplication (``consume_once``): nothing on a new message (the marker insert is the
  record that makes the next delivery a duplicate, and commits with the handler); on a
  duplicate, "maybe seen" must still be confirmed by the database.

So this times, in one process on PostgreSQL and Redis, interleaved: the Redis ``GET`` miss; a
Redis-side filter check (one round trip: a script testing 7 bits, as ``BF.EXISTS`` would; the
RedisBloom module is not assumed); an in-process filter check; and for scale the first-time
claim + complete, a replay from Redis and from the database, and ``consume_once`` for a new and
a duplicate message, with their SQL statements. It also measures the in-process filter's false
positive rate.

    python -m benchmarks.bloom [--iterations 2000] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/idem_speed_bloom"

#: Seven bits per key in a filter sized for a million keys at 1 % false positives.
HASHES = 7
BITS = 9_585_059

#: KEYS[1] is the filter's bitmap; ARGV its bit offsets. "Maybe seen" only when every bit is set.
CHECK_SCRIPT = """
for _, offset in ipairs(ARGV) do
  if redis.call('GETBIT', KEYS[1], offset) == 0 then return 0 end
end
return 1
"""


class BloomFilter:
    """A plain in-process Bloom filter: the cheapest a filter can be in Python."""

    def __init__(self, bits: int = BITS, hashes: int = HASHES) -> None:
        self.bits, self.hashes = bits, hashes
        self.array = bytearray((bits + 7) // 8)

    def offsets(self, key: str) -> list[int]:
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        first, second = int.from_bytes(digest[:8]), int.from_bytes(digest[8:])
        return [(first + i * second) % self.bits for i in range(self.hashes)]

    def add(self, key: str) -> None:
        for offset in self.offsets(key):
            self.array[offset >> 3] |= 1 << (offset & 7)

    def __contains__(self, key: str) -> bool:
        return all(self.array[o >> 3] & (1 << (o & 7)) for o in self.offsets(key))


def timed(operations: dict[str, Callable[[], Any]], iterations: int) -> dict[str, dict[str, float]]:
    """Wall and thread-CPU µs per operation, p50, the operations interleaved."""
    wall: dict[str, list[int]] = {name: [] for name in operations}
    cpu: dict[str, list[int]] = {name: [] for name in operations}
    for _ in range(iterations):
        for name, operation in operations.items():
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            operation()
            wall[name].append(time.perf_counter_ns() - start)
            cpu[name].append(time.thread_time_ns() - start_cpu)
    return {
        name: {
            "wall_p50_us": statistics.median(wall[name]) / 1000,
            "cpu_p50_us": statistics.median(cpu[name]) / 1000,
        }
        for name in operations
    }


def false_positive_rate(keys: int, probes: int) -> float:
    bloom = BloomFilter()
    for number in range(keys):
        bloom.add(f"seen-{number}")
    return sum(f"absent-{number}" in bloom for number in range(probes)) / probes


def child(iterations: int) -> None:
    """Runs in the subprocess, with Django set up on PostgreSQL and the Redis copy."""
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection, transaction
    from django.http import HttpResponse
    from django.test import override_settings
    from django.test.utils import CaptureQueriesContext, setup_test_environment
    from django_redis import get_redis_connection

    setup_test_environment()
    connection.creation.create_test_db(verbosity=0, keepdb=True)
    from django_idempotency.core import types
    from django_idempotency.inbox import consume_once
    from django_idempotency.models import IdempotencyRecord, ProcessedMessage
    from django_idempotency.request import lifecycle, redis_copy

    def view() -> HttpResponse:
        return HttpResponse(b'{"id": 1}', status=201, content_type="application/json")

    def identity(key: str) -> types.Identity:
        return types.Identity("user:1", key, "f" * 64, "POST", "/api/v1/notes/")

    def first_time() -> None:
        decision = lifecycle.claim(identity(str(uuid.uuid4())))
        assert isinstance(decision, types.Proceed)
        lifecycle.run(decision.lease, view)

    def replay() -> None:
        decision = lifecycle.claim(identity(replay_key))
        assert isinstance(decision, types.Replay)

    def consume(message_id: str) -> None:
        with consume_once("bloom-bench", message_id) as consumption:
            if consumption:
                pass  # the handler's own writes would go here

    IdempotencyRecord.objects.all().delete()
    ProcessedMessage.objects.filter(consumer="bloom-bench").delete()
    redis = get_redis_connection("redis")
    check = redis.register_script(CHECK_SCRIPT)
    bloom = BloomFilter()
    bitmap = f"bench:bloom-filter:{uuid.uuid4()}"
    redis.setbit(bitmap, BITS - 1, 0)  # the whole bitmap allocated, as a filter in use would be
    replay_key, duplicate = f"replay-{uuid.uuid4()}", f"duplicate-{uuid.uuid4()}"
    consume(duplicate)
    redis_settings = {**settings.IDEMPOTENCY, "CACHE_ALIAS": "redis"}
    with override_settings(IDEMPOTENCY=redis_settings):
        replay_key_first = lifecycle.claim(identity(replay_key))
        assert isinstance(replay_key_first, types.Proceed)
        lifecycle.run(replay_key_first.lease, view)
        redis_timings = timed(
            {
                "redis_get_miss": lambda: redis_copy.lookup(identity(str(uuid.uuid4()))),
                "redis_filter_check": lambda: check(
                    keys=[bitmap], args=bloom.offsets(str(uuid.uuid4()))
                ),
                "in_process_filter_check": lambda: str(uuid.uuid4()) in bloom,
                "first_time_with_redis": first_time,
                "replay_from_redis": replay,
            },
            iterations,
        )
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "CACHE_ALIAS": None}):
        database_timings = timed(
            {
                "first_time_database": first_time,
                "replay_from_database": replay,
                "consume_new_message": lambda: consume(str(uuid.uuid4())),
                "consume_duplicate": lambda: consume(duplicate),
            },
            iterations,
        )
        statements = {}
        for name, operation in {
            "first_time_database": first_time,
            "consume_new_message": lambda: consume(str(uuid.uuid4())),
            "consume_duplicate": lambda: consume(duplicate),
        }.items():
            with CaptureQueriesContext(connection) as queries:
                operation()
            statements[name] = [query["sql"][:60] for query in queries.captured_queries]
    with transaction.atomic():
        IdempotencyRecord.objects.all().delete()
        ProcessedMessage.objects.filter(consumer="bloom-bench").delete()
    redis.delete(bitmap)
    result = {
        "timings": redis_timings | database_timings,
        "statements": statements,
        "false_positive_rate": false_positive_rate(
            keys=10_000 if iterations < 1000 else 1_000_000, probes=100_000
        ),
    }
    print("BLOOM_RESULT " + json.dumps(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.iterations)
        return 0
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
        "BENCH_VARIANT": "ours",
        "BENCH_DATABASE_URL": os.environ.get("BENCH_BLOOM_URL", DATABASE_URL),
        "PYTHONPATH": str(ROOT),
    }
    iterations = 50 if args.smoke else args.iterations
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.bloom", "--child", "--iterations", str(iterations)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    line = next(
        (line for line in completed.stdout.splitlines() if line.startswith("BLOOM_RESULT ")), None
    )
    if line is None:
        print(completed.stderr, file=sys.stderr)
        return 1
    result = json.loads(line.removeprefix("BLOOM_RESULT "))
    print("| operation | µs wall p50 | µs CPU p50 |\n|---|---:|---:|")
    for name, timing in result["timings"].items():
        print(f"| {name} | {timing['wall_p50_us']:.0f} | {timing['cpu_p50_us']:.0f} |")
    print(f"\nin-process filter false positives: {result['false_positive_rate']:.2%}")
    for name, statements in result["statements"].items():
        print(f"{name}: {len(statements)} statements: {statements}")
    out = ROOT / "artifacts" / ("bloom-smoke.json" if args.smoke else "bloom.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
