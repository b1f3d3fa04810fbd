"""What a claim costs when most of the outbox waits behind failed events (PostgreSQL).

    python benchmarks/relay_blocked.py [--events 100000] [--keys 100]

``--events`` events on ``--keys`` keys; the first event of every key but one is made DEAD (or
backing off for an hour, ``--backoff``), as a poison message or a route refused for good would.
Then a relay tends the outbox once, as ``outbox_relay --loop`` does on its first pass, and the
claims are timed: the first ones drain the free key, the last ones find nothing to claim. Before
HELD events (``outbox/holding.py``), each of those claims read every event behind the failed
ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.relay_settings")
os.environ.setdefault("TEST_DATABASE", "postgresql")

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from benchmarks.relay_deployed import STAGING, TABLE, stage  # noqa: E402
from django_idempotency.models import OutboxEvent  # noqa: E402
from django_idempotency.outbox.relay import Relay  # noqa: E402


def block_every_key_but_one(backoff: bool) -> None:
    heads = f"SELECT min(id) FROM {TABLE} WHERE key <> 'aggregate-0' GROUP BY key"
    failed = "attempts = 1, failure_fingerprint = 'bench', last_error = 'refused'"
    if backoff:
        change = f"{failed}, next_attempt_at = now() + interval '1 hour'"
    else:
        change = f"{failed}, status = 'DEAD'"
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {TABLE}")
        cursor.execute(f"INSERT INTO {TABLE} SELECT * FROM {STAGING}")
        cursor.execute(f"UPDATE {TABLE} SET {change} WHERE id IN ({heads})")
        cursor.execute(f"ANALYZE {TABLE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--backoff", action="store_true", help="heads back off instead of DEAD")
    parser.add_argument("--claims", type=int, default=5)
    args = parser.parse_args()
    # A database of its own, migrated by this checkout, as relay_deployed.py does.
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        run(args)
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


def run(args: argparse.Namespace) -> None:
    stage(args.events, args.keys)
    block_every_key_but_one(args.backoff)
    blocked = "backing off" if args.backoff else "DEAD"
    print(f"{args.events:,} events on {args.keys} keys, every key's first event but one {blocked}")
    with Relay() as relay:
        started = time.perf_counter()
        if hasattr(relay, "tend"):  # a library from before HELD events has none
            relay.tend()
        print(
            f"tend: {time.perf_counter() - started:.2f} s, "
            f"{OutboxEvent.objects.filter(status='HELD').count():,} events held"
        )
        for n in range(args.claims):
            started = time.perf_counter()
            events, _ = relay._claim()
            took = time.perf_counter() - started
            print(f"claim {n + 1}: {len(events)} events in {took * 1000:.1f} ms")
            OutboxEvent.objects.filter(pk__in=[event.pk for event in events]).update(
                status="PUBLISHED",
                published_at=timezone.now(),
                locked_until=None,
                relay_token=None,
            )


if __name__ == "__main__":
    main()
