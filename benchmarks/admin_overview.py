"""How fast the admin's overview page (the last 24 hours) loads on 1,000,000 rows per table.

    POSTGRES_URL=postgres://postgres@127.0.0.1:5432/idem make bench-admin
    POSTGRES_URL=... .venv/bin/python benchmarks/admin_overview.py --days 7

Uses its own database (the URL's name + ``_overview_bench``), filled with ``INSERT ... SELECT
generate_series`` and ANALYZEd (as autovacuum would); a later run within the hour reuses it
(the rows are placed relative to the time of the fill, so an older fill no longer matches the
window), ``--refill`` fills it again.

Idempotency records: ``--rows`` of them claimed evenly over the last ``--days`` days, in
the order they were claimed (1 by
default: every record is in the window, the worst case; with ``TTL_SECONDS`` of a day the table
holds about that), 1 in 1,000 stuck, 1 in 1,000 running, 1 in 500 handed to a worker, 1 in 50
answered 409 and 3 in 50 answered 422, 1 in 200 taken over. Outbox events, failed messages:
as ``benchmarks/admin_health.py`` fills them (1,000,000 events 0.5 s apart, the newest 20,000
pending, 1 in 1,000 dead for eight reasons; 5,000 failed messages in four groups). Prints the
median and the worst time of the page and of each query behind it, and the plans of the two
largest queries.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.admin_health import (  # noqa: E402
    DEAD_ERRORS,
    FAILED_FILL_SQL,
    FAILED_MESSAGES,
    MESSAGE_ERRORS,
    OUTAGE_ERROR,
    OUTBOX_BACKLOG,
    OUTBOX_FILL_SQL,
    TRACEBACK,
    ensure_database,
    measure,
)

RECORDS_SQL = """
INSERT INTO django_idempotency_idempotencyrecord (
    scope, key, fingerprint, status, owner_token, lease_expires_at, attempts, method, path,
    response_status, response_headers, response_body, response_retained, created_at,
    completed_at, expires_at
)
SELECT
    'user:' || (i %% 5000),
    'overview-' || i,
    md5(i::text) || md5((i + 1)::text),
    CASE WHEN i %% 1000 IN (0, 1) THEN 'PROCESSING' WHEN i %% 500 = 7 THEN 'ACCEPTED'
         ELSE 'COMPLETED' END,
    gen_random_uuid(),
    CASE WHEN i %% 1000 = 0 THEN now() - interval '10 minutes'
         WHEN i %% 1000 = 1 OR i %% 500 = 7 THEN now() + interval '1 hour' END,
    CASE WHEN i %% 200 = 9 THEN 2 ELSE 1 END,
    'POST',
    '/api/v1/payments/',
    CASE WHEN i %% 1000 IN (0, 1) THEN NULL WHEN i %% 500 = 7 THEN 202
         WHEN i %% 50 = 3 THEN 409 WHEN i %% 50 IN (4, 5, 6) THEN 422 ELSE 201 END,
    '[["Content-Type", "application/json"]]'::jsonb,
    convert_to('{"id": ' || i || ', "amount": "10.00"}', 'UTF8'),
    true,
    created,
    CASE WHEN i %% 1000 IN (0, 1) OR i %% 500 = 7 THEN NULL ELSE created END,
    created + interval '1 day' * %(days)s
FROM generate_series(1, %(rows)s) AS i,
     LATERAL (SELECT now() - (1 - i::float / %(rows)s) * %(days)s * interval '1 day' AS created)
         AS t
"""


def bench_database() -> tuple[str, str]:
    url = os.environ.get("POSTGRES_URL")
    if not url:
        sys.exit("Set POSTGRES_URL, e.g. postgres://postgres@127.0.0.1:5432/idem")
    parts = urlsplit(url)
    return parts.path.lstrip("/") + "_overview_bench", urlunsplit(parts._replace(path="/postgres"))


def fill(table: str, sql: str, params: dict[str, object], label: str, refill: bool) -> None:
    """Fill ``table`` unless the same fill (``label``) was made within the hour."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT obj_description(%s::regclass)", [table])
        note = cursor.fetchone()[0] or ""
        stamp, _, made = note.partition("@")
        if not refill and stamp == label and made and time.time() - float(made) < 3600:
            print(f"reusing {table} ({label}, filled {int(time.time() - float(made))} s ago)")
            return
        started = time.perf_counter()
        cursor.execute(f"TRUNCATE {table}")
        cursor.execute(sql, params)
        cursor.execute(f"VACUUM ANALYZE {table}")
        cursor.execute(f"COMMENT ON TABLE {table} IS %s", [f"{label}@{time.time()}"])
        print(f"filled {table} ({label}) in {time.perf_counter() - started:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=float, default=1.0, help="records claimed over this many")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--refill", action="store_true", help="insert the rows again")
    args = parser.parse_args()

    name, admin_url = bench_database()
    ensure_database(name, admin_url)
    os.environ.update(
        TEST_DATABASE="postgresql",
        TEST_DATABASE_NAME=name,
        DJANGO_SETTINGS_MODULE="tests.settings",
    )
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.urls import reverse

    from django_idempotency.core.failures import fingerprint_of
    from django_idempotency.models import FailedMessage, IdempotencyRecord, OutboxEvent
    from django_idempotency.operations import health, overview

    started = time.perf_counter()
    call_command("migrate", verbosity=0)
    print(f"migrated in {time.perf_counter() - started:.1f} s")
    records = IdempotencyRecord._meta.db_table
    fill(
        records,
        RECORDS_SQL,
        {"rows": args.rows, "days": args.days},
        f"rows={args.rows},days={args.days}",
        args.refill,
    )
    sizes: dict[str, object] = {
        "rows": args.rows,
        "backlog": OUTBOX_BACKLOG,
        "dead_errors": DEAD_ERRORS,
        "dead_fingerprints": [fingerprint_of(error) for error in DEAD_ERRORS],
        "outage_error": OUTAGE_ERROR,
        "outage_fingerprint": fingerprint_of(OUTAGE_ERROR),
        "traceback": TRACEBACK,
        "failed_messages": FAILED_MESSAGES,
        "message_errors": MESSAGE_ERRORS,
        "message_fingerprints": [fingerprint_of(error) for error in MESSAGE_ERRORS],
    }
    fill(OutboxEvent._meta.db_table, OUTBOX_FILL_SQL, sizes, f"rows={args.rows}", args.refill)
    fill(
        FailedMessage._meta.db_table,
        FAILED_FILL_SQL,
        sizes,
        f"rows={FAILED_MESSAGES}",
        args.refill,
    )

    user, _ = User.objects.get_or_create(
        username="bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    url = reverse("admin:django_idempotency_idempotencyrecord_overview")

    def page() -> object:
        response = client.get(url)
        assert response.status_code == 200, response.status_code
        return response

    window = overview.window()
    results = [
        measure("the overview page", page, args.repeat),
        measure("of which: the health panel", health.snapshot, args.repeat),
        measure("records by outcome and 409s", lambda: overview.record_hours(window), args.repeat),
        measure("keys held now", lambda: overview.held_now(window.now), args.repeat),
        measure(
            "outbox: backlog, published, dead", lambda: overview._outbox_flow(window), args.repeat
        ),
        measure("outbox: commit → publish lag", lambda: overview._outbox_lag(window), args.repeat),
        measure("failure groups", lambda: overview.failure_hours(window), args.repeat),
        measure(
            "for comparison: COUNT(*) of the records", IdempotencyRecord.objects.count, args.repeat
        ),
    ]
    in_window = IdempotencyRecord.objects.filter(created_at__gte=window.start).count()
    print()
    print(
        f"{args.rows:,} records over {args.days:g} days ({in_window:,} in the window), "
        f"{args.rows:,} outbox events, {FAILED_MESSAGES:,} failed messages; PostgreSQL "
        f"{connection.cursor().connection.info.server_version}; milliseconds over "
        f"{args.repeat} runs"
    )
    print()
    print("| what | median ms | worst ms |")
    print("|---|---:|---:|")
    for label, median, worst in results:
        print(f"| {label} | {median:.1f} | {worst:.1f} |")
    counted = overview.record_hours(window)
    flow = overview.outbox_hours(window)
    print()
    print(f"records in the window: {counted.total:,}; backlog now: {flow.backlog[-1]:,}")
    print()
    for title, query in (
        ("records by outcome", overview.records_query(window)),
        ("the outbox's flow", overview.flow_query(window)),
        ("the lag", overview.lag_query(window)),
    ):
        print(f"The plan of {title}:")
        print(query.explain(analyze=True))
        print()


if __name__ == "__main__":
    main()
