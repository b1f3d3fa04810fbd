"""``operations.release_records`` on the real database, including a race with a takeover."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from django_idempotency.core import types
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations import ReleaseResult, release_records
from django_idempotency.request import lifecycle, store
from django_idempotency.request.responses import StoredResponse
from tests.support.factories import IdempotencyRecordFactory


def identity_of(record: IdempotencyRecord) -> types.Identity:
    return types.Identity(
        scope=record.scope,
        key=record.key,
        fingerprint=record.fingerprint,
        method=record.method,
        path=record.path,
    )


@pytest.mark.django_db
def test_releases_stuck_and_completed_and_refuses_running(released):
    IdempotencyRecordFactory(key="done")
    IdempotencyRecordFactory(key="stuck", stuck=True)
    IdempotencyRecordFactory(key="running", running=True)
    result = release_records(IdempotencyRecord.objects.all())
    assert result == ReleaseResult(released=2, refused=1)
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["running"]
    assert sorted(released) == [("user:1", "done", "admin"), ("user:1", "stuck", "admin")]


@pytest.mark.django_db
def test_force_releases_running_leases_too(released):
    IdempotencyRecordFactory(key="running", running=True)
    result = release_records(IdempotencyRecord.objects.all(), force=True, reason="cli")
    assert result == ReleaseResult(released=1, refused=0)
    assert not IdempotencyRecord.objects.exists()
    assert released == [("user:1", "running", "cli")]


@pytest.mark.django_db
def test_works_through_many_batches(released):
    IdempotencyRecordFactory.create_batch(7, stuck=True)
    IdempotencyRecordFactory.create_batch(3, running=True)
    result = release_records(IdempotencyRecord.objects.all(), batch_size=2)
    assert result == ReleaseResult(released=7, refused=3)
    assert IdempotencyRecord.objects.count() == 3
    assert len(set(released)) == 7


@pytest.mark.django_db
def test_a_key_taken_over_since_the_page_was_shown_is_refused():
    """The operator saw a stuck key; a retry took it over before the action ran."""
    record = IdempotencyRecordFactory(stuck=True)
    selection = IdempotencyRecord.objects.filter(pk=record.pk)
    decision = lifecycle.claim(identity_of(record))
    assert isinstance(decision, types.Proceed) and decision.lease.taken_over
    assert release_records(selection) == ReleaseResult(released=0, refused=1)
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_forcing_a_running_lease_makes_its_request_roll_back():
    """Forcing never lets work happen twice: the fenced completion finds no record."""
    record = IdempotencyRecordFactory(stuck=True)
    decision = lifecycle.claim(identity_of(record))
    assert isinstance(decision, types.Proceed)
    release_records(IdempotencyRecord.objects.all(), force=True)
    with transaction.atomic():
        assert store.complete(decision.lease, StoredResponse(status=201, body=b"{}")) is False
    assert not IdempotencyRecord.objects.exists()


def _waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        else:
            # MariaDB reads a row looked up by primary key while planning ("Statistics"), where
            # INNODB_TRX does not report the wait: look for the locking read itself.
            cursor.execute(
                "SELECT count(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() "
                "AND ID <> CONNECTION_ID() AND INFO LIKE '%%FOR UPDATE%%'"
            )
        return bool(cursor.fetchone()[0])


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_release_waits_for_a_concurrent_takeover_and_then_refuses(released):
    """A takeover holding the row when the release arrives wins; the release sees it running.

    Without the row lock the release would judge the stale "stuck" version it read and delete
    the record out from under the request that just took it over.
    """
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: its writers are serialised whole")
    record = IdempotencyRecordFactory(stuck=True)
    locked, take_over, results = threading.Event(), threading.Event(), []

    def takeover_holding_the_row():
        try:
            with transaction.atomic():
                IdempotencyRecord.objects.select_for_update().get(pk=record.pk)
                locked.set()
                take_over.wait(60)
                IdempotencyRecord.objects.filter(pk=record.pk).update(
                    owner_token=uuid.uuid4(),
                    lease_expires_at=timezone.now() + timedelta(seconds=30),
                    attempts=F("attempts") + 1,
                )
        finally:
            connection.close()

    def release():
        try:
            results.append(release_records(IdempotencyRecord.objects.filter(pk=record.pk)))
        finally:
            connection.close()

    holder = threading.Thread(target=takeover_holding_the_row)
    holder.start()
    assert locked.wait(30)
    releaser = threading.Thread(target=release)
    releaser.start()
    deadline = time.monotonic() + 60
    while not _waiting_on_a_lock() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _waiting_on_a_lock(), "the release did not queue behind the takeover's row lock"
    take_over.set()
    holder.join(60)
    releaser.join(60)
    assert results == [ReleaseResult(released=0, refused=1)]
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert released == []


@pytest.mark.django_db
def test_release_of_a_completed_key_lets_the_request_run_again(client, key):
    first = client.post("/api/widget/", {"name": "a"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    release_records(IdempotencyRecord.objects.filter(key=key))
    again = client.post("/api/widget/", {"name": "a"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replay"] == "false"
    assert again.json()["id"] != first.json()["id"]
