"""The prepared statements' cursor (``db/prepared.py``), on PostgreSQL.

One psycopg cursor per connection serves every statement it prepares: kept, not opened and
closed each time, and opened again when the connection is a new one or its time zone changed.
The claim reads its row in binary, which must give what Django's text format gives: the same
bytes, headers and times, naive ones too where ``USE_TZ`` is off.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.http import HttpResponse
from django.test import override_settings

from django_idempotency.core import types
from django_idempotency.db import prepared
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import lifecycle

pytestmark = pytest.mark.django_db(transaction=True)

BODY = bytes(range(256)) * 3
HEADERS = {"Location": "/notes/café", "Content-Type": "application/octet-stream"}


@pytest.fixture(autouse=True)
def _postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are used on PostgreSQL")


def identity(key: str) -> types.Identity:
    return types.Identity(scope="s", key=key, fingerprint="f" * 64, method="POST", path="/x")


def complete(key: str) -> None:
    decision = lifecycle.claim(identity(key))
    assert isinstance(decision, types.Proceed)
    response = HttpResponse(BODY, status=201, headers=HEADERS)
    lifecycle.run(decision.lease, lambda: response)


def kept_cursor(binary: bool = True) -> object:
    with prepared.cursor(connection, binary=binary) as wrapped:
        return wrapped.cursor


def test_one_cursor_serves_every_statement_of_a_connection(key):
    complete(f"{key}-1")
    first = kept_cursor()
    complete(f"{key}-2")
    assert isinstance(lifecycle.claim(identity(f"{key}-1")), types.Replay)
    assert kept_cursor() is first
    assert not first.closed  # type: ignore[attr-defined]
    # The text-format statements (the completion) have a cursor of their own.
    assert kept_cursor(binary=False) is not first


def test_a_new_connection_gets_a_new_cursor(key):
    complete(key)
    before = kept_cursor()
    connection.close()
    replay = lifecycle.claim(identity(key))
    assert isinstance(replay, types.Replay)
    assert replay.response.body == BODY
    after = kept_cursor()
    assert after is not before
    assert after.connection is connection.connection  # type: ignore[attr-defined]


def test_a_replay_read_in_binary_is_the_response_stored(key):
    complete(key)
    replay = lifecycle.claim(identity(key))
    assert isinstance(replay, types.Replay)
    assert replay.response.status == 201
    assert replay.response.body == BODY
    assert dict(replay.response.headers) == HEADERS


def test_a_lease_read_in_binary_is_the_time_the_orm_reads(key):
    decision = lifecycle.claim(identity(key))
    assert isinstance(decision, types.Proceed)
    stored = IdempotencyRecord.objects.get(key=key).lease_expires_at
    assert decision.lease.expires_at == stored
    assert decision.lease.expires_at.utcoffset() == timedelta(0)
    # The same time zone object too, whichever loader read it (psycopg's own, in UTC).
    assert decision.lease.expires_at.tzinfo is stored.tzinfo


def test_without_use_tz_the_times_are_naive_as_the_orms(key):
    aware = kept_cursor()
    with override_settings(USE_TZ=False):
        decision = lifecycle.claim(identity(key))
        assert isinstance(decision, types.Proceed)
        expires = decision.lease.expires_at
        assert expires.tzinfo is None
        assert expires == IdempotencyRecord.objects.get(key=key).lease_expires_at
        # Opened again for the connection's new time zone, not the one before.
        assert kept_cursor() is not aware
        lifecycle.run(decision.lease, lambda: HttpResponse(BODY, status=201))
        assert isinstance(lifecycle.claim(identity(key)), types.Replay)
    assert lifecycle.claim(identity(key)).response.body == BODY  # type: ignore[union-attr]


def test_a_change_of_the_sessions_time_zone_opens_the_cursor_again(key):
    """psycopg's own loader is kept only while the session is in UTC: a session moved to
    another zone gets a cursor that reads times as Django's does, the ORM's zone object too."""
    utc = kept_cursor()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET TIME ZONE 'Etc/UTC'")
        decision = lifecycle.claim(identity(key))
        assert isinstance(decision, types.Proceed)
        assert kept_cursor() is not utc
        stored = IdempotencyRecord.objects.get(key=key).lease_expires_at
        assert decision.lease.expires_at == stored
        assert decision.lease.expires_at.tzinfo is stored.tzinfo
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET TIME ZONE 'UTC'")
