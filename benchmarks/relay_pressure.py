"""Relays under pressure, on PostgreSQL: a backlog of a million events, a transaction elsewhere
holding back the xmin horizon for a minute, and one event in ten failing its first attempt.

    python benchmarks/relay_pressure.py [--backlog 1000000] [--events 200000] [--relays 2]
        [--only backlog] [--outbox-autovacuum] [--sample 30]

Each case fills the outbox, lets ``--relays`` relay processes with default settings drain it
(``benchmarks/relay_fleet.py`` does the running and the checking: lost, sent twice, reordered
per key) and prints one row. The million is written with one ``INSERT … SELECT`` (as a backlog
piles up while the relays are down, not through ``publish()``); the other cases use
``--events``. The xmin case holds a ``REPEATABLE READ`` transaction open on a connection of its
own for ``--hold`` seconds from the relays' start, as a long report or a forgotten ``psql``
session would, and reports the dead rows the table holds when the relays are done.

``--outbox-autovacuum`` gives the outbox the per-table autovacuum settings that
``docs/operations.md`` recommends before each case; ``--sample`` prints, every so many seconds
of the backlog case, how many events are published and how many dead rows the table holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
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


#: docs/operations.md, "PostgreSQL: the outbox under pressure".
RECOMMENDED_AUTOVACUUM = (
    "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000, "
    "autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0, "
    "autovacuum_analyze_threshold = 10000"
)


def tune_autovacuum() -> None:
    table = connection.ops.quote_name(OutboxEvent._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} SET ({RECOMMENDED_AUTOVACUUM})")


@contextmanager
def sampled(every: float) -> Iterator[None]:
    """Print the published count, the dead rows and vacuum's runs every ``every`` seconds."""
    stop = threading.Event()

    def sample() -> None:
        watcher = connections.create_connection("default")
        started, last = time.monotonic(), 0
        try:
            while not stop.wait(every):
                with watcher.cursor() as cursor:
                    cursor.execute(
                        "SELECT count(*) FILTER (WHERE status = 'PUBLISHED') FROM "
                        f"{connection.ops.quote_name(OutboxEvent._meta.db_table)}"
                    )
                    published = cursor.fetchone()[0]
                    cursor.execute(
                        "SELECT n_dead_tup, autovacuum_count, autoanalyze_count "
                        "FROM pg_stat_user_tables WHERE relname = %s",
                        [OutboxEvent._meta.db_table],
                    )
                    dead, vacuums, analyzes = cursor.fetchone()
                print(
                    f"  {time.monotonic() - started:6.0f} s: {published:,} published "
                    f"({(published - last) / every:,.0f}/s), {dead:,} dead rows, "
                    f"autovacuum {vacuums}, autoanalyze {analyzes}",
                    flush=True,
                )
                last = published
        finally:
            watcher.close()

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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
    parser.add_argument("--only", choices=["events", "xmin", "failing", "backlog"])
    parser.add_argument("--outbox-autovacuum", action="store_true")
    parser.add_argument("--sample", type=float, default=0.0)
    parser.add_argument(
        "--server-autovacuum",
        choices=["on", "off", "as-is"],
        default="as-is",
        help="switch the server's autovacuum for the run (ALTER SYSTEM; restored after)",
    )
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        raise SystemExit("Run with TEST_DATABASE=postgresql and POSTGRES_URL set.")
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        with server_autovacuum(args.server_autovacuum):
            cases(args)
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


@contextmanager
def server_autovacuum(wanted: str) -> Iterator[None]:
    """The server's ``autovacuum`` set to ``wanted`` for the run, then back as it was. (A
    server set up for fast test runs may have it off, and the outbox is then never vacuumed.)"""
    if wanted != "as-is":
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER SYSTEM SET autovacuum = {wanted}")
            cursor.execute("SELECT pg_reload_conf()")
        time.sleep(1)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SHOW autovacuum")
            print(f"server autovacuum: {cursor.fetchone()[0]}")
        yield
    finally:
        if wanted != "as-is":
            with connection.cursor() as cursor:
                cursor.execute("ALTER SYSTEM RESET autovacuum")
                cursor.execute("SELECT pg_reload_conf()")


def cases(args: argparse.Namespace) -> None:
    print(f"{args.relays} relays, default settings, {args.keys} keys, in-memory publisher")
    print("| case | events/s | wall s | share per relay | lost / twice / reordered "
          "| PostgreSQL CPU s | dead rows after |")  # fmt: skip
    print("|---|---:|---:|---|---|---:|---:|")

    def fill(count: int, keys: int) -> None:
        fill_with_sql(count, keys)
        if args.outbox_autovacuum:
            tune_autovacuum()

    def wanted(case: str) -> bool:
        return args.only in (None, case)

    if wanted("events"):
        row(f"{args.events:,} events", run(args.relays, args.events, args.keys, None,
            fill_with=fill), f"{dead_rows():,}")  # fmt: skip
    if wanted("xmin"):
        row(
            f"{args.events:,} events, xmin held {args.hold:.0f} s",
            run(args.relays, args.events, args.keys, None, fill_with=fill,
                alongside=lambda: xmin_held(args.hold)),
            f"{dead_rows():,}",
        )  # fmt: skip
    if wanted("failing"):
        row(
            f"{args.events:,} events, 1 in 10 failing once",
            run(args.relays, args.events, args.keys, None, fill_with=fill,
                env_extra={"FLEET_FAIL_ONE_IN": "10"}),
        )  # fmt: skip
    if wanted("backlog"):
        row(
            f"{args.backlog:,} events backlog",
            run(args.relays, args.backlog, args.keys, None, fill_with=fill,
                alongside=(lambda: sampled(args.sample)) if args.sample else nullcontext),
            f"{dead_rows():,}",
        )  # fmt: skip


if __name__ == "__main__":
    main()
