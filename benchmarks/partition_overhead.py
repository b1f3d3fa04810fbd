"""Day partitions on PostgreSQL: what they cost ``publish()`` and ``consume_once()``.

    TEST_DATABASE=postgresql python benchmarks/partition_overhead.py --rows 100000
    # needs POSTGRES_URL (settings: tests.settings); databases di_poverhead*

Builds two throwaway databases (``di_poverhead`` and ``di_poverhead_partitioned``, both dropped
at the end, also when the run fails), plain tables in the first; in the second the outbox and
inbox tables are moved to day partitions (``partition_table``, ``OUTBOX_PARTITIONS`` and
``INBOX_PARTITIONS`` on), with a partition for each of the last ``--past-days`` days before
today's and the ones ``PARTITION_AHEAD_DAYS`` ahead. Both are filled alike with ``--rows``
published events and ``--rows`` inbox markers of one consumer, spread over the last two days
(``INSERT ... SELECT generate_series``, then ``VACUUM ANALYZE``, so that autovacuum has nothing
left to do while the timings run). Then it times, one at a time, each in a transaction of its
own and commit included:

* ``publish()`` of one keyless event with a drawn id (a fresh uuid4: no look-up on either layout);
* ``publish()`` of one keyless event with a given ``event_id=uuid4()`` (partitioned: the id's
  advisory lock, then a look-up of the id across every partition, then the insert);
* ``consume_once(consumer, message_id)`` of a fresh message with an empty body (partitioned: the
  message's advisory lock, then an insert that first looks the marker up in every partition).

As in benchmarks/retention.py, the two layouts are timed in alternating blocks of
:data:`BLOCK` after a ``CHECKPOINT``, switching the default connection between the databases,
so that neither gets the quieter moments; the order of the three operations turns with each
block. Each switch opens a new connection, and each operation then runs :data:`WARM_UP` times
untimed first, so the timings are of a warm session (prepared statements and plans cached), as
on a persistent connection (``CONN_MAX_AGE``). ``--explain`` prints ``EXPLAIN ANALYZE`` of the
given-id look-up and of the marker insert on the partitioned tables (each the second time it
runs in the session, as the timed operations run warm).

Prints a table of p50 and p99 in ms and writes ``benchmarks/results/partition_overhead.json``:
``rows``, ``past_days``, ``timed`` (per operation and layout), ``partitions_outbox``,
``partitions_inbox``, and ``<operation>_<p50|p99>_ms_<plain|partitioned>`` for the operations
``publish_drawn``, ``publish_given`` and ``consume``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("TEST_DATABASE", "postgresql")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import override_settings  # noqa: E402

from django_idempotency.db import database_now  # noqa: E402
from django_idempotency.db import postgresql as pg  # noqa: E402
from django_idempotency.inbox.consumers import consume_once  # noqa: E402
from django_idempotency.models import FailedMessage, OutboxEvent, ProcessedMessage  # noqa: E402
from django_idempotency.operations import partitions  # noqa: E402
from django_idempotency.operations.partitions import INBOX, OUTBOX, Layout  # noqa: E402
from django_idempotency.outbox.publish import publish  # noqa: E402

DATABASE = "di_poverhead"
PARTITIONED_DATABASE = "di_poverhead_partitioned"
#: Operations timed per block; the blocks alternate between the two layouts.
BLOCK = 250
#: Untimed runs of each operation after each switch of database (a new connection).
WARM_UP = 10
RESULTS = Path(__file__).resolve().parent / "results" / "partition_overhead.json"
OUTBOX_TABLE = OutboxEvent._meta.db_table
INBOX_TABLE = ProcessedMessage._meta.db_table
TOPIC = "orders.paid"
CONSUMER = "billing.charge"
#: A typical small event.
PAYLOAD = {"order_id": "ord_0000000000", "amount": "19.99", "currency": "EUR"}
OPERATIONS = ("publish_drawn", "publish_given", "consume")
LABELS = {
    "publish_drawn": "publish(), drawn event id",
    "publish_given": "publish(event_id=uuid4())",
    "consume": "consume_once(), new message",
}


def sql(statement: str, params: Any = None) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone() if cursor.description else None


def fill(rows: int) -> None:
    """``rows`` published events and ``rows`` markers, spread over the last two days."""
    now = database_now("default")
    start = now - timedelta(days=2)
    # Up to a minute ago: the timed rows come after all of them.
    step = (timedelta(days=2) - timedelta(minutes=1)).total_seconds() / max(rows, 1)
    payload = json.dumps(PAYLOAD)
    for first in range(0, rows, 500_000):
        last = min(first + 500_000, rows)
        sql(
            f'INSERT INTO "{OUTBOX_TABLE}" (event_id, topic, key, payload, headers, status, '
            "attempts, next_attempt_at, last_error, transaction_id, created_at, published_at) "
            "SELECT gen_random_uuid(), %s, 'order-' || (g %% 10000), %s::jsonb, '{}'::jsonb, "
            "'PUBLISHED', 0, %s + make_interval(secs => g * %s), '', 0, "
            "%s + make_interval(secs => g * %s), %s + make_interval(secs => g * %s + 1) "
            "FROM generate_series(%s, %s) AS g",
            [TOPIC, payload, start, step, start, step, start, step, first, last - 1],
        )
        sql(
            f'INSERT INTO "{INBOX_TABLE}" (consumer, message_id, processed_at) '
            "SELECT %s, gen_random_uuid()::text, %s + make_interval(secs => g * %s) "
            "FROM generate_series(%s, %s) AS g",
            [CONSUMER, start, step, first, last - 1],
        )
    sql("VACUUM ANALYZE")


def use(database: str) -> None:
    """Point the default connection at ``database`` (the next statement reconnects)."""
    connection.close()
    connection.settings_dict["NAME"] = database


def layout(partitioned: bool, idempotency: dict[str, Any]) -> Any:
    """The settings of one layout: its database, ``OUTBOX_PARTITIONS`` and ``INBOX_PARTITIONS``."""
    use(PARTITIONED_DATABASE if partitioned else DATABASE)
    return override_settings(
        IDEMPOTENCY={
            **idempotency,
            "OUTBOX_PARTITIONS": partitioned,
            "INBOX_PARTITIONS": partitioned,
        }
    )


def partition(layout_: Layout, past_days: int) -> int:
    """Move ``layout_``'s table to day partitions: ``past_days`` days before today's, today's
    and those ahead (the legacy partition, empty, ends where the first day starts). Returns
    how many partitions the table has."""
    today = partitions.window_start(database_now("default"))
    start = today - timedelta(days=past_days)
    partitions.partition_table(bound=start, layout=layout_)
    existing = {part.name for part in partitions.partitions(layout=layout_)}
    while start < today:
        if partitions.partition_name(start, layout_) not in existing:
            partitions.create_partition(start, start + timedelta(days=1), layout=layout_)
        start += timedelta(days=1)
    return len(partitions.partitions(layout=layout_))


def publish_drawn() -> None:
    with transaction.atomic():
        publish(TOPIC, PAYLOAD)


def publish_given() -> None:
    with transaction.atomic():
        publish(TOPIC, PAYLOAD, event_id=uuid.uuid4())


def consume() -> None:
    with consume_once(CONSUMER, str(uuid.uuid4())) as consumption:
        assert consumption, "a new message was taken for a duplicate"


RUNS: dict[str, Callable[[], None]] = {
    "publish_drawn": publish_drawn,
    "publish_given": publish_given,
    "consume": consume,
}


def time_block(operation: str, count: int) -> list[float]:
    run = RUNS[operation]
    for _ in range(WARM_UP):
        run()
    timings = []
    for _ in range(count):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return timings


def p99(timings: list[float]) -> float:
    return statistics.quantiles(timings, n=100, method="inclusive")[98]


def measure(count: int, idempotency: dict[str, Any]) -> dict[str, Any]:
    """p50 and p99 of each operation on each layout, timed in alternating blocks of
    :data:`BLOCK` after a checkpoint, the operations' order turning with each block."""
    sql("CHECKPOINT")
    timings: dict[tuple[str, bool], list[float]] = {
        (operation, partitioned): [] for operation in OPERATIONS for partitioned in (False, True)
    }
    for block in range(max(1, count // BLOCK)):
        turn = block % len(OPERATIONS)
        order = OPERATIONS[turn:] + OPERATIONS[:turn]
        for partitioned in (False, True) if block % 2 == 0 else (True, False):
            with layout(partitioned, idempotency):
                sql("SELECT 1")  # connect, outside the timings
                for operation in order:
                    timings[operation, partitioned] += time_block(operation, BLOCK)
    result: dict[str, Any] = {"timed": len(timings[OPERATIONS[0], False])}
    for operation in OPERATIONS:
        for partitioned, name in ((False, "plain"), (True, "partitioned")):
            taken = timings[operation, partitioned]
            result[f"{operation}_p50_ms_{name}"] = round(statistics.median(taken) * 1000, 3)
            result[f"{operation}_p99_ms_{name}"] = round(p99(taken) * 1000, 3)
    return result


def explain() -> None:
    """``EXPLAIN ANALYZE`` of what the partitioned layout adds, on the current database."""
    quote = connection.ops.quote_name
    lookup = OutboxEvent.objects.filter(event_id=uuid.uuid4()).query.exists()
    statement, params = lookup.get_compiler(using="default").as_sql()  # what exists() runs
    marker = pg.insert_marker(
        quote(INBOX_TABLE),
        quote(FailedMessage._meta.db_table),
        *(quote(name) for name in ("consumer", "message_id", "processed_at")),
        partitioned=True,
    )
    at = database_now("default")
    with connection.cursor() as cursor:
        for title, text, values in (
            ("given event id, looked up across the outbox partitions", statement, params),
            (
                "inbox marker, looked up across the partitions and inserted (rolled back)",
                marker,
                {"consumer": CONSUMER, "message_id": str(uuid.uuid4()), "at": at},
            ),
        ):
            for _ in range(2):  # the second, in a session that has loaded the partitions
                with transaction.atomic():
                    cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, SUMMARY) {text}", values)
                    plan = [row[0] for row in cursor.fetchall()]
                    transaction.set_rollback(True)
            print(f"-- {title}")
            print("\n".join(plan))


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'operation':30} {'p50 plain':>10} {'p50 part.':>10} {'ratio':>6} "
        f"{'p99 plain':>10} {'p99 part.':>10}"
    ]
    for operation in OPERATIONS:
        plain, parted = (result[f"{operation}_p50_ms_{name}"] for name in ("plain", "partitioned"))
        lines.append(
            f"{LABELS[operation]:30} {plain:10.3f} {parted:10.3f} {parted / plain:6.2f} "
            f"{result[f'{operation}_p99_ms_plain']:10.3f} "
            f"{result[f'{operation}_p99_ms_partitioned']:10.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="old events, and old markers")
    parser.add_argument(
        "--past-days", type=int, default=2, help="day partitions before today's (default 2)"
    )
    parser.add_argument("--count", type=int, default=2000, help="timed runs per operation")
    parser.add_argument("--explain", action="store_true", help="EXPLAIN ANALYZE the look-ups")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        raise SystemExit("Run with TEST_DATABASE=postgresql and POSTGRES_URL set.")
    count = max(2 * BLOCK, args.count // (2 * BLOCK) * 2 * BLOCK)  # whole pairs of blocks
    idempotency = dict(getattr(settings, "IDEMPOTENCY", {}))
    old_name = connection.settings_dict["NAME"]
    test = connection.settings_dict.setdefault("TEST", {})
    created: list[str] = []
    try:
        for name in (DATABASE, PARTITIONED_DATABASE):
            test["NAME"] = name
            connection.creation.create_test_db(verbosity=0, keepdb=False)
            created.append(name)
        print(f"{args.rows} old events and {args.rows} old markers per layout")
        with layout(False, idempotency):
            fill(args.rows)
        with layout(True, idempotency):
            parts = {
                f"partitions_{layout_.label}": partition(layout_, args.past_days)
                for layout_ in (OUTBOX, INBOX)
            }
            fill(args.rows)
            print(f"partitioned: {parts}")
            if args.explain:
                explain()
        result = measure(count, idempotency)
    finally:
        for name in reversed(created):
            use(name)
            connection.creation.destroy_test_db(old_name, verbosity=0)
    report = {"rows": args.rows, "past_days": args.past_days, **parts, **result}
    print(f"{report['timed']} timed per operation and layout, in blocks of {BLOCK}")
    print(table(report))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
