"""Relays under pressure, on PostgreSQL: a backlog of a million events, a transaction elsewhere
holding back the xmin horizon for a minute, and one event in ten failing its first attempt.

    python benchmarks/relay_pressure.py [--backlog 1000000] [--events 200000] [--relays 2]

Each case fills the outbox, lets ``--relays`` relay processes with default settings drain it
(``benchmarks/relay_fleet.py`` does the running and the checking: lost, sent twice, reordered
per key) and prints one row. The million is written with one ``INSERT … SELECT`` (as a backlog
piles up while the relays are down, not through ``publish()``); the other cases use
``--events``. The xmin case holds a ``REPEATABLE READ`` transaction open on a connection of its
own for ``--hold`` seconds from the relays' start, as a long report or a forgotten ``psql``
session would, and reports the dead rows the table holds when the relays are done.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("TEST_DATABASE", "postgresql")

from django.db import connection, connections, transaction  # noqa: E402

from benchmarks.relay_fleet import run  # noqa: E402  (sets Django up)
from django_idempotency.models import OutboxEvent  # noqa: E402


def fill_with_sql(count: int, keys: int) -> None:
    """``count`` pending events over ``keys`` keys, in one statement."""
    OutboxEvent.objects.all().delete()
    table = connection.ops.quote_name(OutboxEvent._meta.db_table)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (event_id, topic, key, payload, headers, status, attempts, "
            "next_attempt_at, last_error, transaction_id, created_at) "
            "SELECT gen_random_uuid(), 'orders.paid', 'aggregate-' || (n %% %s), "
            "jsonb_build_object('order', n, 'total', '19.99'), '{}'::jsonb, 'PENDING', 0, "
            "now(), '', 0, now() FROM generate_series(1, %s) AS n",
            [keys, count],
        )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")


@contextmanager
def xmin_held(seconds: float) -> Iterator[None]:
    """A REPEATABLE READ transaction, with its snapshot taken, open for ``seconds``."""
    holder = connections.create_connection("default")
    holder.ensure_connection()
    raw = holder.connection
    raw.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    raw.execute("SELECT count(*) FROM django_migrations")
    timer = threading.Timer(seconds, raw.rollback)
    timer.start()
    try:
        yield
    finally:
        timer.join()
        holder.close()


def dead_rows() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s",
            [OutboxEvent._meta.db_table],
        )
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def row(name: str, result: dict[str, Any], extra: str = "") -> None:
    shares = " / ".join(f"{share:,}" for share in result["shares"])
    print(
        f"| {name} | {result['events_per_second']:,.0f} | {result['elapsed']:.1f} | {shares} "
        f"| {result['lost']} / {result['duplicates']} / {result['reordered']} "
        f"| {result['database_cpu']:.1f} | {extra} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--relays", type=int, default=2)
    parser.add_argument("--hold", type=float, default=60.0)
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        raise SystemExit("Run with TEST_DATABASE=postgresql and POSTGRES_URL set.")
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        print(f"{args.relays} relays, default settings, {args.keys} keys, in-memory publisher")
        print("| case | events/s | wall s | share per relay | lost / twice / reordered "
              "| PostgreSQL CPU s | dead rows after |")  # fmt: skip
        print("|---|---:|---:|---|---|---:|---:|")
        row(f"{args.events:,} events", run(args.relays, args.events, args.keys, None,
            fill_with=fill_with_sql), f"{dead_rows():,}")  # fmt: skip
        row(
            f"{args.events:,} events, xmin held {args.hold:.0f} s",
            run(args.relays, args.events, args.keys, None, fill_with=fill_with_sql,
                alongside=lambda: xmin_held(args.hold)),
            f"{dead_rows():,}",
        )  # fmt: skip
        row(
            f"{args.events:,} events, 1 in 10 failing once",
            run(args.relays, args.events, args.keys, None, fill_with=fill_with_sql,
                env_extra={"FLEET_FAIL_ONE_IN": "10"}),
        )  # fmt: skip
        row(f"{args.backlog:,} events backlog", run(args.relays, args.backlog, args.keys, None,
            fill_with=fill_with_sql), f"{dead_rows():,}")  # fmt: skip
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
