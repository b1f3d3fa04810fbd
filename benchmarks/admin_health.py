"""How fast the admin's health panel and changelists stay on 1,000,000 rows per table.

    POSTGRES_URL=postgres://postgres@127.0.0.1:5432/idem \
        .venv/bin/python benchmarks/admin_health.py

Uses its own database (the URL's name + ``_bench``), filled once with ``INSERT ... SELECT
generate_series`` and ANALYZEd (as autovacuum would); later runs reuse it unless ``--refill``.
Idempotency records: 1 in 1,000 stuck (lease expired), 1 in 1,000 running, 1 in 20 expired,
the rest completed. Outbox events: the newest 20,000 pending (a broker outage's backlog, 1 in
10 of them failing, all for the outage), 1 in 1,000 dead (for eight reasons: eight failure
groups), the rest published; failed events carry their fingerprint and a 2 KB traceback, as
the relay records them. Processed messages: five consumers over two weeks. Failed messages:
5,000, in four failure groups. Prints median and worst times for the health snapshot,
changelist pages, the failure groups pages and, for comparison, the exact ``COUNT(*)`` the
admin never runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FILL_SQL = """
INSERT INTO django_idempotency_idempotencyrecord (
    scope, key, fingerprint, status, owner_token, lease_expires_at, attempts, method, path,
    response_status, response_headers, response_body, response_retained, created_at,
    completed_at, expires_at
)
SELECT
    'user:' || (i %% 5000),
    'bench-' || i,
    md5(i::text) || md5((i + 1)::text),
    CASE WHEN i %% 1000 IN (0, 1) THEN 'PROCESSING' ELSE 'COMPLETED' END,
    gen_random_uuid(),
    CASE WHEN i %% 1000 = 0 THEN now() - interval '10 minutes'
         WHEN i %% 1000 = 1 THEN now() + interval '1 hour' END,
    1,
    'POST',
    '/api/v1/payments/',
    CASE WHEN i %% 1000 IN (0, 1) THEN NULL ELSE 201 END,
    '[["Content-Type", "application/json"]]'::jsonb,
    convert_to('{"id": ' || i || ', "amount": "10.00"}', 'UTF8'),
    true,
    now() - (i %% 86400) * interval '1 second',
    CASE WHEN i %% 1000 IN (0, 1) THEN NULL ELSE now() - (i %% 86400) * interval '1 second' END,
    CASE WHEN i %% 20 = 2 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END
FROM generate_series(1, %s) AS i
"""

#: The newest events that are still pending: the backlog a broker outage leaves.
OUTBOX_BACKLOG = 20_000

#: Why the dead events died: eight failure groups.
DEAD_ERRORS = [
    "PublishError: webhook https://partner.example/hooks/*** answered 410",
    "PublishError: webhook https://partner.example/hooks/*** answered 422",
    "PublishError: unroutable: no queue bound for 'refunds.issued'",
    "PublishError: unroutable: no queue bound for 'invoices.sent'",
    "PublishError: send_task failed: ContentDisallowed('Refusing to serialize')",
    "UnroutableTopic: no OUTBOX_PUBLISHERS route matches the topic 'orders.shipped'",
    "TypeError: Object of type Decimal is not JSON serializable",
    "PublishError: webhook https://ledger.example/in/*** failed: ReadTimeout",
]
#: Why the failing part of the backlog waits: the broker is down.
OUTAGE_ERROR = "BrokerUnavailable: AMQP broker unreachable: ConnectionRefusedError(111)"
#: A traceback as long as a real chained one (the relay bounds them at 8,000 characters).
TRACEBACK = (
    "Traceback (most recent call last):\n"
    + '  File "/srv/app/.venv/lib/python3.12/site-packages/httpx/_client.py", line 1014, in '
    "_send_single_request\n    response = transport.handle_request(request)\n"
    * 16
    + "httpx.ReadTimeout (message not stored)\n"
)

OUTBOX_FILL_SQL = """
INSERT INTO django_idempotency_outboxevent (
    event_id, topic, key, payload, headers, status, attempts, next_attempt_at, locked_until,
    relay_token, last_error, transaction_id, created_at, published_at, traceparent,
    failure_fingerprint, failing_since, last_failed_at, failure_traceback
)
SELECT
    gen_random_uuid(),
    (ARRAY['orders.paid', 'orders.shipped', 'invoices.sent', 'payments.captured',
           'refunds.issued'])[1 + i %% 5],
    'order-' || (i %% 50000),
    ('{"order_id": ' || i || ', "total": "10.00", "currency": "EUR"}')::jsonb,
    '{"tenant": "acme"}'::jsonb,
    CASE WHEN i > total - %(backlog)s THEN 'PENDING'
         WHEN i %% 1000 = 0 THEN 'DEAD' ELSE 'PUBLISHED' END,
    CASE WHEN i %% 1000 = 0 THEN 10 WHEN i > total - %(backlog)s AND i %% 10 = 0 THEN 2
         ELSE 0 END,
    now() - (total - i) * interval '500 milliseconds',
    NULL,
    NULL,
    CASE WHEN i %% 1000 = 0 THEN (%(dead_errors)s::text[])[1 + i / 1000 %% 8]
         WHEN i > total - %(backlog)s AND i %% 10 = 0 THEN %(outage_error)s ELSE '' END,
    1000 + i / 3,
    now() - (total - i) * interval '500 milliseconds',
    CASE WHEN i > total - %(backlog)s OR i %% 1000 = 0 THEN NULL
         ELSE now() - (total - i) * interval '500 milliseconds' + interval '40 milliseconds' END,
    '00-' || md5(i::text) || '-' || left(md5((i + 1)::text), 16) || '-01',
    CASE WHEN i %% 1000 = 0 THEN (%(dead_fingerprints)s::text[])[1 + i / 1000 %% 8]
         WHEN i > total - %(backlog)s AND i %% 10 = 0 THEN %(outage_fingerprint)s END,
    CASE WHEN i %% 1000 = 0 OR (i > total - %(backlog)s AND i %% 10 = 0)
         THEN now() - (total - i) * interval '500 milliseconds' + interval '1 second' END,
    CASE WHEN i %% 1000 = 0 OR (i > total - %(backlog)s AND i %% 10 = 0)
         THEN now() - (total - i) * interval '250 milliseconds' END,
    CASE WHEN i %% 1000 = 0 OR (i > total - %(backlog)s AND i %% 10 = 0) THEN %(traceback)s END
FROM generate_series(1, %(rows)s) AS i, (SELECT %(rows)s AS total) AS size
"""

#: Messages whose handler raised, for four reasons: the failure groups page's second section.
FAILED_MESSAGES = 5_000
MESSAGE_ERRORS = [
    "LookupError: no ledger account for customer 4242",
    "LedgerDown: ledger 10.0.0.7 refused entry 1041",
    'IntegrityError: duplicate key value violates unique constraint "ledger_entry_ref"',
    "TimeoutError: search index did not answer within 5.0 s",
]

FAILED_FILL_SQL = """
INSERT INTO django_idempotency_failedmessage (
    consumer, message_id, attempts, last_error, failure_fingerprint, failing_since,
    last_failed_at, failure_traceback
)
SELECT
    (ARRAY['billing.charge', 'shipping.ship', 'mail.receipt', 'ledger.post',
           'search.index'])[1 + i %% 5],
    md5(('failed' || i)::text)::uuid::text,
    1 + i %% 7,
    (%(message_errors)s::text[])[1 + i %% 4],
    (%(message_fingerprints)s::text[])[1 + i %% 4],
    now() - (i %% 86400) * interval '1 second' - interval '1 hour',
    now() - (i %% 86400) * interval '1 second',
    %(traceback)s
FROM generate_series(1, %(failed_messages)s) AS i
"""

PROCESSED_FILL_SQL = """
INSERT INTO django_idempotency_processedmessage (consumer, message_id, processed_at)
SELECT
    (ARRAY['billing.charge', 'shipping.ship', 'mail.receipt', 'ledger.post',
           'search.index'])[1 + i %% 5],
    md5(i::text)::uuid::text,
    now() - (i %% 1209600) * interval '1 second'
FROM generate_series(1, %(rows)s) AS i
"""


def bench_url() -> tuple[str, str]:
    url = os.environ.get("POSTGRES_URL")
    if not url:
        sys.exit("Set POSTGRES_URL, e.g. postgres://postgres@127.0.0.1:5432/idem_ops")
    parts = urlsplit(url)
    name = parts.path.lstrip("/") + "_bench"
    return name, urlunsplit(parts._replace(path="/postgres"))


def ensure_database(name: str, admin_url: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as connection:
        exists = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
        if exists.fetchone() is None:
            connection.execute(f'CREATE DATABASE "{name}"')


def fill(table: str, sql: str, params: object, rows: int, refill: bool) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table}")
        if cursor.fetchone()[0] == rows and not refill:
            print(f"reusing {rows:,} rows of {table}")
            return
        started = time.perf_counter()
        cursor.execute(f"TRUNCATE {table}")
        cursor.execute(sql, params)
        cursor.execute(f"VACUUM ANALYZE {table}")
        print(f"inserted {rows:,} rows into {table} in {time.perf_counter() - started:.1f} s")


def measure(label: str, run: Callable[[], object], repeat: int) -> tuple[str, float, float]:
    for _ in range(3):
        run()  # warm caches and connections, as a live admin would be
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return label, statistics.median(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--refill", action="store_true", help="insert the rows again")
    args = parser.parse_args()

    name, admin_url = bench_url()
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
    from django.test import Client
    from django.urls import reverse

    from django_idempotency.core.failures import fingerprint_of
    from django_idempotency.models import (
        FailedMessage,
        IdempotencyRecord,
        OutboxEvent,
        ProcessedMessage,
    )
    from django_idempotency.operations import health

    call_command("migrate", verbosity=0)
    fill(IdempotencyRecord._meta.db_table, FILL_SQL, [args.rows], args.rows, args.refill)
    sizes = {
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
    fill(OutboxEvent._meta.db_table, OUTBOX_FILL_SQL, sizes, args.rows, args.refill)
    fill(ProcessedMessage._meta.db_table, PROCESSED_FILL_SQL, sizes, args.rows, args.refill)
    fill(FailedMessage._meta.db_table, FAILED_FILL_SQL, sizes, FAILED_MESSAGES, args.refill)
    user, _ = User.objects.get_or_create(
        username="bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    changelist = reverse("admin:django_idempotency_idempotencyrecord_changelist")
    detail = reverse(
        "admin:django_idempotency_idempotencyrecord_change",
        args=[IdempotencyRecord.objects.order_by("-pk").values_list("pk", flat=True)[0]],
    )

    events = reverse("admin:django_idempotency_outboxevent_changelist")
    latest_event = OutboxEvent.objects.order_by("-pk").values_list("pk", "event_id")[0]
    event_detail = reverse("admin:django_idempotency_outboxevent_change", args=[latest_event[0]])
    processed = reverse("admin:django_idempotency_processedmessage_changelist")
    failures = reverse("admin:django_idempotency_outboxevent_failures")
    outage = fingerprint_of(OUTAGE_ERROR)
    requeue_outage = reverse(
        "admin:django_idempotency_outboxevent_failure_group", args=[outage, "requeue"]
    )

    def groups() -> object:
        return OutboxEvent.objects.failure_groups()[:50]

    def page(url: str) -> Callable[[], object]:
        def get() -> object:
            response = client.get(url)
            assert response.status_code == 200, response.status_code
            return response

        return get

    results = [
        measure("health snapshot (all figures)", health.snapshot, args.repeat),
        measure("health: the outbox section", health.outbox_health, args.repeat),
        measure("changelist, no filter", page(changelist), args.repeat),
        measure("changelist, stuck=yes", page(f"{changelist}?stuck=yes"), args.repeat),
        measure(
            "changelist, status=COMPLETED",
            page(f"{changelist}?status__exact=COMPLETED"),
            args.repeat,
        ),
        measure("changelist, expired=yes", page(f"{changelist}?expired=yes"), args.repeat),
        measure("changelist, search by scope", page(f"{changelist}?q=user:42"), args.repeat),
        measure("changelist, search by key", page(f"{changelist}?q=bench-4242"), args.repeat),
        measure("detail page", page(detail), args.repeat),
        measure("for comparison: exact COUNT(*)", IdempotencyRecord.objects.count, args.repeat),
        measure("outbox changelist, no filter", page(events), args.repeat),
        measure("outbox changelist, dead", page(f"{events}?status__exact=DEAD"), args.repeat),
        measure("outbox changelist, pending", page(f"{events}?status__exact=PENDING"), args.repeat),
        measure("outbox changelist, failed", page(f"{events}?failed=yes"), args.repeat),
        measure("outbox changelist, topic", page(f"{events}?topic=refunds.issued"), args.repeat),
        measure(
            "outbox changelist, search by event id",
            page(f"{events}?q={latest_event[1]}"),
            args.repeat,
        ),
        measure("outbox changelist, search by key", page(f"{events}?q=order-4242"), args.repeat),
        measure("outbox detail page", page(event_detail), args.repeat),
        measure("for comparison: outbox COUNT(*)", OutboxEvent.objects.count, args.repeat),
        measure("failure groups: the query", lambda: list(groups()), args.repeat),
        measure("failure groups page", page(failures), args.repeat),
        measure(
            "failure groups page, one topic", page(f"{failures}?topic=refunds.issued"), args.repeat
        ),
        measure("failure groups page, dead only", page(f"{failures}?state=dead"), args.repeat),
        measure("a group's requeue page (2,000 events)", page(requeue_outage), args.repeat),
        measure(
            "outbox changelist, one failure group",
            page(f"{events}?failure={outage}"),
            args.repeat,
        ),
        measure("processed messages changelist", page(processed), args.repeat),
        measure(
            "processed messages, one consumer",
            page(f"{processed}?consumer=ledger.post"),
            args.repeat,
        ),
    ]
    print()
    print(f"{args.rows:,} rows per table on PostgreSQL; milliseconds over {args.repeat} runs")
    print()
    print("| what | median ms | worst ms |")
    print("|---|---:|---:|")
    for label, median, worst in results:
        print(f"| {label} | {median:.1f} | {worst:.1f} |")
    print()
    for section in health.snapshot():
        figures = ", ".join(f"{figure.label}: {figure.value}" for figure in section.figures)
        print(f"{section.title}: {figures}")
    print(f"Failure groups: {len(list(groups()))}")
    print()
    print("The failure groups query's plan:")
    print(OutboxEvent.objects.failure_groups()[:50].explain())


if __name__ == "__main__":
    main()
