"""A database without the app's tables: ``check --database`` says which migrations to run, and
every door answers a guarded request 503 problem+json naming the fix, never a 500."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection
from django.test import Client

from django_idempotency.db import schema_missing
from django_idempotency.models import IdempotencyRecord
from tests.testapp import doors

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = IdempotencyRecord._meta.db_table
AWAY = f"{TABLE}_away"
DOORS = [
    "middleware",
    "middleware-drf",
    "middleware-async",
    "decorator",
    "decorator-async",
    "api-function",
    "mixin",
]


def rename(old: str, new: str) -> None:
    quote = connection.ops.quote_name
    connection.close()  # a fresh session: nothing prepared against the old name
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {quote(old)} RENAME TO {quote(new)}")
    connection.close()


@pytest.fixture
def records_table_missing() -> Iterator[None]:
    """The records table gone, as on a database where the app was never migrated."""
    rename(TABLE, AWAY)
    try:
        yield
    finally:
        rename(AWAY, TABLE)


@pytest.mark.parametrize("door", DOORS)
def test_every_door_answers_503_naming_the_migration(
    records_table_missing: None, door: str, key: str, caplog: Any
) -> None:
    http = Client(raise_request_exception=False)
    with caplog.at_level(logging.ERROR, logger="django_idempotency"):
        response = http.post(
            doors.DOORS[door], "{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body["error"] == "idempotency_store_not_migrated"
    assert "manage.py migrate django_idempotency" in body["detail"]
    assert int(response["Retry-After"]) >= 1
    # One line for the operator, naming the fix, without a traceback.
    (line,) = [
        record
        for record in caplog.records
        if record.name.startswith("django_idempotency") and record.levelno >= logging.ERROR
    ]
    assert "manage.py migrate django_idempotency" in line.getMessage()
    assert line.exc_info is None


def test_the_door_answers_again_once_migrated(key: str) -> None:
    http = Client()
    rename(TABLE, AWAY)
    try:
        first = http.post(
            doors.DOORS["mixin"], "{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )
    finally:
        rename(AWAY, TABLE)
    assert first.status_code == 503
    again = http.post(
        doors.DOORS["mixin"], "{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert again.status_code < 500


def test_check_database_names_the_missing_table_and_the_command(
    records_table_missing: None,
) -> None:
    with pytest.raises(SystemCheckError) as raised:
        call_command("check", "--database", "default", stdout=StringIO(), stderr=StringIO())
    report = str(raised.value)
    assert "django_idempotency.E084" in report
    assert TABLE in report
    assert "manage.py migrate django_idempotency" in report


def test_check_without_database_does_not_connect(records_table_missing: None) -> None:
    out = StringIO()
    call_command("check", stdout=out, stderr=StringIO())
    assert "E084" not in out.getvalue()


def test_other_database_errors_are_not_taken_for_missing_tables() -> None:
    with pytest.raises(Exception) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT nonsense FROM")
    assert not schema_missing(raised.value)
    with pytest.raises(Exception) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM django_idempotency_no_such_table")
    assert schema_missing(raised.value)
