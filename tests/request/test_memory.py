"""Answers kept in the process's memory for a retry storm (``LOCAL_REPLAY_SECONDS``,
``request/memory.py``): replays without a query, on every door, and never past what the
record allows: another caller, another request, the record's expiry, a release, the size bound.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from django.test import Client
from freezegun import freeze_time

from django_idempotency.core.types import Identity, StoredResponse
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations.actions import release_records
from django_idempotency.request import memory, redis_copy
from tests.request.test_lifecycle_doors import ALL, send
from tests.request.test_redis_copy import configure
from tests.support.factories import UserFactory
from tests.testapp import doors
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def kept(idempotency_settings: Any) -> None:
    idempotency_settings(LOCAL_REPLAY_SECONDS=30)


def identity(key: str, scope: str = "tenant", fingerprint: str = "f" * 64) -> Identity:
    return Identity(scope, key, fingerprint, "POST", "/api/widget/")


@pytest.mark.parametrize("door", ALL)
def test_a_retry_is_replayed_from_memory_without_a_query(
    door, key, kept, django_assert_num_queries
):
    http = Client()
    first = send(http, door, key, name="a")
    assert first.status_code == 201, first.content
    with django_assert_num_queries(0):
        replay = send(http, door, key, name="a")
    assert replay.status_code == 201
    assert replay["Idempotent-Replay"] == "true"
    assert replay.content == first.content
    # Another request under the same key is the database's to judge: 422, not the kept answer.
    assert send(http, door, key, name="b").status_code == 422
    assert doors.calls[key] == 1


def test_off_by_default_every_retry_asks_the_database(key, django_assert_num_queries):
    http = Client()
    assert send(http, "mixin", key, name="a").status_code == 201
    with django_assert_num_queries(1):
        assert send(http, "mixin", key, name="a")["Idempotent-Replay"] == "true"
    assert memory.lookup(identity(key, "anonymous")) is None


def test_a_database_replay_is_kept_too(key, kept, idempotency_settings, django_assert_num_queries):
    http = Client()
    idempotency_settings(LOCAL_REPLAY_SECONDS=0)
    assert send(http, "mixin", key, name="a").status_code == 201  # completed, nothing kept
    idempotency_settings(LOCAL_REPLAY_SECONDS=30)
    with django_assert_num_queries(1):
        assert send(http, "mixin", key, name="a")["Idempotent-Replay"] == "true"
    with django_assert_num_queries(0):
        assert send(http, "mixin", key, name="a")["Idempotent-Replay"] == "true"


def test_a_kept_answer_never_crosses_callers(key, kept):
    alice, bob = Client(), Client()
    alice.force_login(UserFactory())
    bob.force_login(UserFactory())
    mine = alice.post(
        "/api/widget/", json.dumps({"name": "a"}), content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )  # fmt: skip
    theirs = bob.post(
        "/api/widget/", json.dumps({"name": "a"}), content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )  # fmt: skip
    assert mine.status_code == theirs.status_code == 201
    assert theirs["Idempotent-Replay"] == "false"
    assert Widget.objects.count() == 2


def test_nothing_is_kept_past_the_records_expiry(key, kept):
    with freeze_time() as clock:  # the monotonic clock too: no host is too slow for 50 ms
        memory.remember(identity(key), StoredResponse(201, [], b"soon gone"), expires_in=0.05)
        clock.tick(0.04)
        assert memory.lookup(identity(key)) is not None
        clock.tick(0.02)
        assert memory.lookup(identity(key)) is None
    # An expiry that is not known keeps nothing; one already past keeps nothing either.
    memory.remember(identity(key), StoredResponse(201, [], b"x"), expires_in=None)
    memory.remember(identity(key, "other"), StoredResponse(201, [], b"x"), expires_in=-1)
    assert memory.lookup(identity(key)) is None
    assert memory.lookup(identity(key, "other")) is None


def test_nothing_is_kept_longer_than_the_setting(key, idempotency_settings):
    idempotency_settings(LOCAL_REPLAY_SECONDS=0.05)
    with freeze_time() as clock:
        memory.remember(identity(key), StoredResponse(201, [], b"x"), expires_in=3600)
        clock.tick(0.04)
        assert memory.lookup(identity(key)) is not None
        clock.tick(0.02)
        assert memory.lookup(identity(key)) is None


def test_a_release_in_this_process_is_seen_at_once(key, kept):
    http = Client()
    assert send(http, "mixin", key, name="a").status_code == 201
    assert send(http, "mixin", key, name="a")["Idempotent-Replay"] == "true"
    release_records(IdempotencyRecord.objects.filter(key=key))
    again = send(http, "mixin", key, name="a")
    assert again.status_code == 201
    assert again["Idempotent-Replay"] == "false"
    assert doors.calls[key] == 2


def test_the_least_recently_used_answer_goes_first(idempotency_settings):
    idempotency_settings(LOCAL_REPLAY_SECONDS=30, LOCAL_REPLAY_ENTRIES=2)
    for name in ("a", "b"):
        memory.remember(identity(name), StoredResponse(201, [], name.encode()), expires_in=60)
    assert memory.lookup(identity("a")) is not None  # a is now the most recently used
    memory.remember(identity("c"), StoredResponse(201, [], b"c"), expires_in=60)
    assert memory.lookup(identity("b")) is None
    assert memory.lookup(identity("a")) is not None
    assert memory.lookup(identity("c")) is not None


def test_a_redis_copys_expiry_is_never_later_than_its_records(monkeypatch):
    """The copy carries its record's expiry to the millisecond, rounded down: read at once, it
    never says the record lives longer than it does."""
    encoded = redis_copy._encode("f", StoredResponse(201, [], b"{}"), expires_at=1120.0006)
    monkeypatch.setattr(redis_copy, "time", SimpleNamespace(time=lambda: 1000.0))
    replay = redis_copy._decode(encoded, "f")
    assert replay is not None and replay.expires_in is not None
    assert 119.999 <= replay.expires_in <= 120.0006


def test_a_redis_copy_carries_its_records_expiry(key, settings, redis_url):
    configure(settings, redis_url)
    stored = StoredResponse(201, [("Content-Type", "application/json")], b"{}")
    redis_copy.remember(identity(key), stored, ttl_seconds=120)
    replay = redis_copy.lookup(identity(key))
    assert replay is not None and replay.response == stored
    assert replay.expires_in is not None and 110 < replay.expires_in <= 120
