"""Retention of idempotency records on PostgreSQL: the DELETE sweep against dropping a partition.

    make bench-retention ROWS=1000000     # needs POSTGRES_URL; databases di_retention*

Builds the same records twice in a throwaway database (``di_retention``, dropped at the end):
``ROWS`` expired records, all created in one day's partition two days ago (COMPLETED, expired
a day later, as with the default 24 h TTL), and one day's live records (``--live-rows``,
``ROWS`` by default) created over the last 24 hours, which span today's and yesterday's
partitions. Then it times retention both ways:

* plain table, ``RECORD_PARTITIONS`` off: ``sweep_expired_records()`` (batches of
  ``SWEEP_BATCH_SIZE``, one short transaction each) and then ``VACUUM`` of the table, which the
  database needs before it can reuse the space (autovacuum is off on the table while the
  benchmark runs, so the timing is the benchmark's own);
* partitioned table: ``apply_retention()``, which detaches and drops the expired day's
  partition.

Each way reports its wall time, the WAL it wrote (``pg_current_wal_lsn()`` before and after),
and the table's size afterwards (heap, TOAST and indexes of every partition). The two layouts
live in two databases (``di_retention`` and ``di_retention_partitioned``), both filled before
either is timed, so that first-time claims (``claims.claim`` of fresh keys, one at a time, in
autocommit as a request's claim runs) can be timed against both in alternating blocks after a
``CHECKPOINT``: timed one layout after the other, each right after its own fill and the other's
sweep, the two medians differed by as much as a fifth between runs of the same code, and by the
order they ran in. Last, the partitioned table is moved back to a plain one
(``unpartition_table``) and the time writes waited is printed, for the per-million-rows figure
of docs/operations.md; before that, the plain table the sweep left (the live records) is moved
to partitions (``partition_table``), and the time of each step printed (validating the CHECK,
during which writes go on; the swap, during which claims wait).

Writes ``benchmarks/results/retention.json`` with exactly the keys ``rows, delete_seconds,
drop_seconds, delete_wal_bytes, drop_wal_bytes, table_bytes_after_delete,
table_bytes_after_drop, claim_p50_ms_partitioned, claim_p50_ms_plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("TEST_DATABASE", "postgresql")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import override_settings  # noqa: E402

from django_idempotency.core.types import Identity, Proceed  # noqa: E402
from django_idempotency.db import database_now  # noqa: E402
from django_idempotency.models import IdempotencyRecord  # noqa: E402
from django_idempotency.operations import partitions  # noqa: E402
from django_idempotency.operations.sweeps import sweep_expired_records  # noqa: E402
from django_idempotency.request import claims  # noqa: E402

DATABASE = "di_retention"
PARTITIONED_DATABASE = "di_retention_partitioned"
#: Claims timed per block; the blocks alternate between the two layouts.
CLAIM_BLOCK = 250
RESULTS = Path(__file__).resolve().parent / "results" / "retention.json"
TABLE = IdempotencyRecord._meta.db_table
#: A stored response of a typical size: a small JSON body.
BODY = b'{"id": "ord_0000000000", "status": "paid", "amount": "19.99", "currency": "EUR"}'


def sql(statement: str, params: Any = None) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone() if cursor.description else None


def fill(rows: int, live_rows: int) -> None:
    """``rows`` expired records two days ago, ``live_rows`` over the last 24 hours."""
    day = partitions.window_start(database_now("default"))
    expired_from = day - timedelta(days=2)
    # Live for at least ten more minutes: none expires while the benchmark runs.
    live_from = database_now("default") - timedelta(days=1) + timedelta(minutes=10)
    columns = (
        "scope, key, fingerprint, status, owner_token, lease_expires_at, attempts, method, "
        "path, response_status, response_headers, response_body, response_retained, "
        "created_at, completed_at, expires_at"
    )
    for prefix, count, start, span in (
        ("expired", rows, expired_from, timedelta(days=1)),
        ("live", live_rows, live_from, timedelta(days=1) - timedelta(minutes=11)),
    ):
        step = span.total_seconds() / max(count, 1)
        for first in range(0, count, 500_000):
            last = min(first + 500_000, count)
            sql(
                f'INSERT INTO "{TABLE}" ({columns}) SELECT '
                "'user:' || (g %% 10000), %s || '-' || g, repeat('f', 64), 'COMPLETED', "
                "gen_random_uuid(), NULL, 1, 'POST', '/api/orders/', 201, "
                '\'[["Content-Type", "application/json"]]\'::jsonb, %s, true, '
                "%s + make_interval(secs => g * %s), %s + make_interval(secs => g * %s), "
                "%s + make_interval(secs => g * %s) + interval '1 day' "
                "FROM generate_series(%s, %s) AS g",
                [prefix, BODY, start, step, start, step, start, step, first, last - 1],
            )
    sql("ANALYZE")


def leaves() -> list[str]:
    """The tables that hold the rows: the partitions, or the plain table itself."""
    if not partitions.is_partitioned():
        return [f'"{TABLE}"']
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relid::regclass::text FROM pg_partition_tree(%s::regclass) WHERE isleaf",
            [f'"{TABLE}"'],
        )
        return [row[0] for row in cursor.fetchall()]


def table_bytes() -> int:
    """Heap, TOAST and indexes of every table that holds rows."""
    return sum(
        int(sql("SELECT pg_total_relation_size(%s::regclass)", [name])[0]) for name in leaves()
    )


def wal() -> int:
    return int(sql("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0])


def autovacuum_off() -> None:
    for name in leaves():
        sql(f"ALTER TABLE {name} SET (autovacuum_enabled = false)")


def use(database: str) -> None:
    """Point the default connection at ``database`` (the next statement reconnects)."""
    connection.close()
    connection.settings_dict["NAME"] = database


def layout(partitioned: bool, idempotency: dict[str, Any]) -> Any:
    """The settings of one layout: its database, and ``RECORD_PARTITIONS``."""
    use(PARTITIONED_DATABASE if partitioned else DATABASE)
    return override_settings(IDEMPOTENCY={**idempotency, "RECORD_PARTITIONS": partitioned})


def time_claims(count: int) -> list[float]:
    timings = []
    for _ in range(count):
        identity = Identity(
            scope="user:bench", key=f"claim-{uuid.uuid4()}", fingerprint="e" * 64,
            method="POST", path="/api/orders/",
        )  # fmt: skip
        started = time.perf_counter()
        decision = claims.claim(identity, uuid.uuid4())
        timings.append(time.perf_counter() - started)
        assert isinstance(decision, Proceed), decision
    # The claims hold their owner locks (nothing completes them): let go of them all.
    sql("SELECT pg_advisory_unlock_all()")
    return timings


def claim_p50_ms(claims: int, idempotency: dict[str, Any]) -> dict[str, float]:
    """Median first-time claim on each layout, timed in alternating blocks of
    :data:`CLAIM_BLOCK` after a checkpoint, so that neither layout gets the quieter moments."""
    sql("CHECKPOINT")
    timings: dict[bool, list[float]] = {False: [], True: []}
    for block in range(max(1, claims // CLAIM_BLOCK)):
        for partitioned in (False, True) if block % 2 == 0 else (True, False):
            with layout(partitioned, idempotency):
                timings[partitioned] += time_claims(CLAIM_BLOCK)
    return {
        "claim_p50_ms_plain": round(statistics.median(timings[False]) * 1000, 3),
        "claim_p50_ms_partitioned": round(statistics.median(timings[True]) * 1000, 3),
    }


def fill_plain(rows: int, live_rows: int) -> None:
    fill(rows, live_rows)
    autovacuum_off()


def plain(rows: int) -> dict[str, Any]:
    before, started = wal(), time.perf_counter()
    deleted = sweep_expired_records()
    sql(f'VACUUM "{TABLE}"')
    seconds = time.perf_counter() - started
    written = wal() - before
    assert deleted == rows, (deleted, rows)
    print(f"plain: swept {deleted} rows and vacuumed in {seconds:.2f} s, WAL {written} bytes")
    return {
        "delete_seconds": round(seconds, 3),
        "delete_wal_bytes": written,
        "table_bytes_after_delete": table_bytes(),
    }


def move(count: int) -> None:
    """The migration, timed on the plain table the sweep left (its live records)."""
    steps: list[str] = []
    started = time.perf_counter()
    partitions.partition_table(verbose=steps.append)
    took = time.perf_counter() - started
    print(f"partition: {count} rows, {took:.2f} s in all; " + " ".join(steps))
    waited = partitions.unpartition_table()
    print(f"unpartition: {count} rows, writes waited {waited:.2f} s")


def fill_partitioned(rows: int, live_rows: int) -> None:
    now = database_now("default")
    partitions.partition_table(bound=partitions.window_start(now) - timedelta(days=2))
    # Partitions from two days ago: the expired day's, yesterday's and today's (and ahead).
    start = partitions.window_start(now) - timedelta(days=2)
    while start < partitions.window_start(now):
        if partitions.partition_name(start) not in {part.name for part in partitions.partitions()}:
            partitions.create_partition(start, start + timedelta(days=1))
        start += timedelta(days=1)
    fill(rows, live_rows)
    autovacuum_off()


def partitioned(live_rows: int, claims: int) -> dict[str, Any]:
    before, started = wal(), time.perf_counter()
    outcomes = partitions.apply_retention()
    seconds = time.perf_counter() - started
    written = wal() - before
    dropped = [outcome.partition for outcome in outcomes if outcome.action == "dropped"]
    refused = [outcome for outcome in outcomes if outcome.action == "refused"]
    assert not refused, refused
    print(f"partitioned: dropped {dropped} in {seconds:.3f} s, WAL {written} bytes")
    assert IdempotencyRecord.objects.count() == live_rows + claims
    result = {
        "drop_seconds": round(seconds, 3),
        "drop_wal_bytes": written,
        "table_bytes_after_drop": table_bytes(),
    }
    count = IdempotencyRecord.objects.count()
    waited = partitions.unpartition_table()
    print(
        f"unpartition: {count} rows copied back to a plain table, writes waited {waited:.2f} s "
        f"({waited / max(count, 1) * 1_000_000:.2f} s per million rows)"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="expired records")
    parser.add_argument(
        "--live-rows", type=int, default=None, help="one day's live records (default: --rows)"
    )
    parser.add_argument("--claims", type=int, default=2000, help="claims timed per layout")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        raise SystemExit("Run with TEST_DATABASE=postgresql and POSTGRES_URL set.")
    live_rows = args.rows if args.live_rows is None else args.live_rows
    claims = max(CLAIM_BLOCK, args.claims // CLAIM_BLOCK * CLAIM_BLOCK)
    test = connection.settings_dict.setdefault("TEST", {})
    test["NAME"] = DATABASE
    old_name = connection.creation.create_test_db(verbosity=0, keepdb=False)
    test["NAME"] = PARTITIONED_DATABASE
    connection.creation.create_test_db(verbosity=0, keepdb=False)
    idempotency = {**getattr(settings, "IDEMPOTENCY", {}), "TTL_SECONDS": 86400}
    try:
        print(f"retention of {args.rows} expired records beside {live_rows} live ones")
        with layout(False, idempotency):
            fill_plain(args.rows, live_rows)
        with layout(True, idempotency):
            fill_partitioned(args.rows, live_rows)
        result = claim_p50_ms(claims, idempotency)
        print(f"first-time claims, {claims} per layout: {result}")
        with layout(False, idempotency):
            result.update(plain(args.rows))
        with override_settings(IDEMPOTENCY={**idempotency, "RECORD_PARTITIONS": True}):
            move(live_rows + claims)  # on the plain table the sweep left
        with layout(True, idempotency):
            result.update(partitioned(live_rows, claims))
    finally:
        use(PARTITIONED_DATABASE)
        connection.creation.destroy_test_db(DATABASE, verbosity=0)
        connection.creation.destroy_test_db(old_name, verbosity=0)
    keys = [
        "rows",
        "delete_seconds",
        "drop_seconds",
        "delete_wal_bytes",
        "drop_wal_bytes",
        "table_bytes_after_delete",
        "table_bytes_after_drop",
        "claim_p50_ms_partitioned",
        "claim_p50_ms_plain",
    ]
    report = {"rows": args.rows, **result}
    report = {key: report[key] for key in keys}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
