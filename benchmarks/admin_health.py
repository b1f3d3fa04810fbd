"""How fast the admin's health panel and changelist stay on 1,000,000 idempotency records.

    POSTGRES_URL=postgres://postgres@127.0.0.1:5432/idem \
        .venv/bin/python benchmarks/admin_health.py

Uses its own database (the URL's name + ``_bench``), filled once with ``INSERT ... SELECT
generate_series`` and ANALYZEd (as autovacuum would); later runs reuse it unless ``--refill``.
The mix: 1 in 1,000 records stuck (lease expired), 1 in 1,000 running, 1 in 20 expired, the
rest completed. Prints median and worst times for the health snapshot, changelist pages and,
for comparison, the exact ``COUNT(*)`` the admin no longer runs.
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


def fill(rows: int, refill: bool) -> None:
    from django.db import connection

    from django_idempotency.models import IdempotencyRecord

    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table}")
        if cursor.fetchone()[0] == rows and not refill:
            print(f"reusing {rows:,} records")
            return
        started = time.perf_counter()
        cursor.execute(f"TRUNCATE {table}")
        cursor.execute(FILL_SQL, [rows])
        cursor.execute(f"ANALYZE {table}")
        print(f"inserted {rows:,} records in {time.perf_counter() - started:.1f} s")


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

    from django_idempotency import health
    from django_idempotency.models import IdempotencyRecord

    call_command("migrate", verbosity=0)
    fill(args.rows, args.refill)
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

    def page(url: str) -> Callable[[], object]:
        def get() -> object:
            response = client.get(url)
            assert response.status_code == 200, response.status_code
            return response

        return get

    results = [
        measure("health snapshot (all figures)", health.snapshot, args.repeat),
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
    ]
    print()
    print(f"{args.rows:,} records on PostgreSQL; milliseconds over {args.repeat} runs")
    print()
    print("| what | median ms | worst ms |")
    print("|---|---:|---:|")
    for label, median, worst in results:
        print(f"| {label} | {median:.1f} | {worst:.1f} |")
    print()
    for section in health.snapshot():
        figures = ", ".join(f"{figure.label}: {figure.value}" for figure in section.figures)
        print(f"{section.title}: {figures}")


if __name__ == "__main__":
    main()
