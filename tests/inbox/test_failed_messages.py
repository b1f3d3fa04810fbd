"""Failed inbox messages: what ``consume_once`` records when a handler raises, when the record
goes, and forgetting records (``operations.actions.forget_failed_messages``)."""

from __future__ import annotations

import logging
import threading

import pytest
from django.db import DatabaseError, connection, connections, transaction

from django_idempotency import signals
from django_idempotency.core.failures import fingerprint_of
from django_idempotency.db.querysets import FailedMessageQuerySet
from django_idempotency.inbox import consume_once
from django_idempotency.models import FailedMessage, ProcessedMessage
from django_idempotency.operations.actions import forget_failed_messages
from tests.support.metrics_support import SampleDelta
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


class LedgerDown(Exception):
    pass


def fail(message_id: str, error: Exception, *, consumer: str = "billing") -> None:
    with pytest.raises(type(error)), consume_once(consumer, message_id):
        Widget.objects.create(name="half")
        raise error


def handle(message_id: str, *, consumer: str = "billing") -> bool:
    with consume_once(consumer, message_id) as consumption:
        if not consumption:
            return False
        Widget.objects.create(name="done")
        return True


def test_a_failure_is_recorded_outside_the_rolled_back_transaction():
    fail("m-1", LedgerDown("ledger 10.0.0.7 refused entry 1041"))
    assert not ProcessedMessage.objects.exists() and not Widget.objects.exists()
    record = FailedMessage.objects.get()
    assert (record.consumer, record.message_id, record.attempts) == ("billing", "m-1", 1)
    assert record.last_error == "LedgerDown: ledger 10.0.0.7 refused entry 1041"
    assert record.failure_fingerprint == fingerprint_of(record.last_error)
    assert record.failing_since == record.last_failed_at
    assert "Traceback (most recent call last):" in record.failure_traceback
    assert record.failure_traceback.rstrip().endswith(record.last_error.split(": ", 1)[1])


def test_repeated_failures_count_and_a_new_reason_restarts_the_group_clock():
    fail("m-1", LedgerDown("entry 1 refused"))
    first = FailedMessage.objects.get()
    fail("m-1", LedgerDown("entry 2 refused"))  # the same reason, another number
    again = FailedMessage.objects.get()
    assert again.attempts == 2
    assert (again.failure_fingerprint, again.failing_since) == (
        first.failure_fingerprint,
        first.failing_since,
    )
    assert again.last_failed_at >= first.last_failed_at
    fail("m-1", KeyError("account"))
    changed = FailedMessage.objects.get()
    assert changed.attempts == 3
    assert changed.failure_fingerprint != first.failure_fingerprint
    assert changed.failing_since == changed.last_failed_at >= again.last_failed_at


def test_the_handling_that_succeeds_takes_the_record_with_it():
    fail("m-1", LedgerDown("down"))
    fail("m-2", LedgerDown("down"))
    assert handle("m-1") is True
    assert list(FailedMessage.objects.values_list("message_id", flat=True)) == ["m-2"]
    assert ProcessedMessage.objects.filter(message_id="m-1").exists()


def test_ids_that_differ_only_in_case_or_a_trailing_space_are_separate_records():
    """On MariaDB and MySQL the columns compare byte for byte (migration 0007), as the inbox
    markers' do: under the default collations 'm-a' equals 'M-A' and 'm-a ', so two messages
    would share one failure record, and handling one would delete the other's."""
    for message_id in ("m-a", "M-A", "m-a "):
        fail(message_id, LedgerDown("down"))
    fail("m-a", LedgerDown("down"), consumer="BILLING")
    failed = FailedMessage.objects.order_by("pk")
    assert list(failed.values_list("consumer", "message_id", "attempts")) == [
        ("billing", "m-a", 1),
        ("billing", "M-A", 1),
        ("billing", "m-a ", 1),
        ("BILLING", "m-a", 1),
    ]
    assert handle("M-A") is True
    assert sorted(failed.values_list("consumer", "message_id")) == [
        ("BILLING", "m-a"),
        ("billing", "m-a"),
        ("billing", "m-a "),
    ]


def test_a_success_that_rolls_back_keeps_the_record():
    fail("m-1", LedgerDown("down"))
    with pytest.raises(RuntimeError), transaction.atomic():
        assert handle("m-1") is True
        raise RuntimeError("the caller's transaction fails after the handler")
    assert FailedMessage.objects.filter(message_id="m-1").exists()
    assert not ProcessedMessage.objects.exists()


def test_a_duplicate_is_no_failure():
    assert handle("m-1") is True
    with pytest.raises(RuntimeError), consume_once("billing", "m-1") as consumption:
        assert not consumption
        raise RuntimeError("the caller raised while skipping")
    assert not FailedMessage.objects.exists()


def test_inside_an_outer_transaction_the_record_belongs_to_it():
    with transaction.atomic():
        fail("m-1", LedgerDown("down"))
        assert FailedMessage.objects.filter(message_id="m-1").exists()
        transaction.set_rollback(True)
    assert not FailedMessage.objects.exists()
    with transaction.atomic():
        fail("m-2", LedgerDown("down"))
    assert FailedMessage.objects.filter(message_id="m-2").exists()


def test_a_database_that_cannot_take_the_record_never_hides_the_handlers_error(monkeypatch, caplog):
    def broken(self, **kwargs):
        raise DatabaseError("disk full")

    monkeypatch.setattr(FailedMessageQuerySet, "create", broken)
    caplog.set_level(logging.WARNING, logger="django_idempotency.inbox.consumers")
    fail("m-1", LedgerDown("down"))  # LedgerDown, not DatabaseError, reaches the caller
    assert [r.getMessage() for r in caplog.records] == [
        "the consumer's failure could not be recorded"
    ]
    assert handle("m-1") is True  # the connection is usable


@pytest.mark.concurrency
def test_concurrent_failures_of_one_message_are_one_record():
    """Two workers record a failure of the same message at the same moment (a redelivery racing
    the first attempt): one inserts the record, the other's insert waits for it, fails on the
    unique constraint, and counts its attempt on the same record."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite serialises writers: nothing runs at once")
    from django_idempotency.inbox.consumers import Consumption, _record_failure

    barrier = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            consumption = Consumption("billing", "m-1", duplicate=False)
            barrier.wait()
            _record_failure(consumption, LedgerDown("down"), "default")
        except BaseException as exc:  # pragma: no cover - shown by the assertion below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    record = FailedMessage.objects.get()
    assert record.attempts == 2


def test_groups_of_failed_messages():
    for n in range(3):
        fail(f"m-{n}", LedgerDown(f"entry {n} refused"), consumer="ledger.post")
    fail("m-9", LedgerDown("entry 9 refused"), consumer="billing")
    fail("m-5", KeyError("account"), consumer="billing")
    groups = {g["failure_fingerprint"]: g for g in FailedMessage.objects.failure_groups()}
    ledger = groups[fingerprint_of("LedgerDown: entry 1 refused")]
    assert (ledger["messages"], ledger["consumers"], ledger["consumer"]) == (4, 2, "billing")
    assert ledger["first_seen"] <= ledger["last_seen"]
    assert groups[fingerprint_of("KeyError: 'account'")]["messages"] == 1


def test_forgetting_records_is_batched_announced_and_counted(caplog):
    for n in range(5):
        fail(f"m-{n}", LedgerDown("down"))
    fail("m-9", KeyError("account"))
    metrics = SampleDelta(
        {
            "group": (
                "django_idempotency_inbox_failures_forgotten_total",
                {"target": "failure_group"},
            ),
        }
    )
    seen = []

    def receiver(sender, *, count, failure_group, **kwargs):
        seen.append((count, failure_group))

    signals.failures_forgotten.connect(receiver)
    caplog.set_level(logging.INFO, logger="django_idempotency.operations.actions")
    fingerprint = fingerprint_of("LedgerDown: down")
    try:
        group = FailedMessage.objects.in_failure_group(fingerprint)
        assert forget_failed_messages(group, batch_size=2, failure_group=fingerprint) == 5
    finally:
        signals.failures_forgotten.disconnect(receiver)
    assert list(FailedMessage.objects.values_list("message_id", flat=True)) == ["m-9"]
    assert seen == [(5, fingerprint)]
    assert metrics.delta() == {"group": 5}
    assert [r.getMessage() for r in caplog.records] == ["inbox: 5 failed messages forgotten"]
