"""The demo's ledger consumer against the suite's database: one pair of entries per event,
however the event is delivered (twice, concurrently, relayed again, or after a failure)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import transaction
from django.test import override_settings

from demo_project.payments import services, tasks
from demo_project.payments.models import Account, LedgerEntry, Payment
from django_idempotency import signals
from django_idempotency.models import OutboxEvent, ProcessedMessage
from django_idempotency.outbox.relay import Relay
from django_idempotency.testing import assert_publishes, deliver_concurrently, deliver_twice
from tests.support.outbox_support import settings_with

pytestmark = pytest.mark.django_db(transaction=True)

#: The demo's routes without a broker (demo_project/settings.py).
IN_PROCESS_ROUTES = {
    topic: {
        "BACKEND": "demo_project.payments.inprocess.InProcessTaskPublisher",
        "OPTIONS": {"task": f"demo_project.payments.tasks.{task}"},
    }
    for topic, task in (
        (services.PAYMENT_COMPLETED, "record_payment"),
        (services.PAYMENT_REFUNDED, "record_refund"),
    )
}


@pytest.fixture
def payment() -> Payment:
    source = Account.objects.create(name="ledger_a", balance=Decimal("100.00"))
    destination = Account.objects.create(name="ledger_b", balance=Decimal("0.00"))
    with transaction.atomic():
        return services.create_payment(
            amount=Decimal("30.00"), currency="USD", source=source, destination=destination
        )


def event_of(payment: Payment, topic: str = services.PAYMENT_COMPLETED) -> OutboxEvent:
    return OutboxEvent.objects.get(event_id=services.event_id(topic, payment))


def sides(topic: str = services.PAYMENT_COMPLETED) -> list[tuple[str, str, Decimal]]:
    return sorted(
        LedgerEntry.objects.filter(topic=topic).values_list("side", "account__name", "amount")
    )


PAID = [("credit", "ledger_b", Decimal("30.00")), ("debit", "ledger_a", Decimal("30.00"))]


def test_a_payment_publishes_its_event_in_its_transaction() -> None:
    source = Account.objects.create(name="ledger_a", balance=Decimal("100.00"))
    destination = Account.objects.create(name="ledger_b", balance=Decimal("0.00"))
    published = assert_publishes(1, topic=services.PAYMENT_COMPLETED, key="ledger_a")
    with published as events, transaction.atomic():
        payment = services.create_payment(
            amount=Decimal("30.00"), currency="USD", source=source, destination=destination
        )
    (event,) = events
    assert event.event_id == services.event_id(services.PAYMENT_COMPLETED, payment)
    assert event.payload == {
        "transaction_id": str(payment.transaction_id),
        "amount": "30.00",
        "currency": "USD",
        "source_account": "ledger_a",
        "destination_account": "ledger_b",
    }
    # A payment refused for want of funds rolls back its event with it.
    with pytest.raises(Exception, match="insufficient funds"), transaction.atomic():
        services.create_payment(
            amount=Decimal("999.00"), currency="USD", source=source, destination=destination
        )
    assert OutboxEvent.objects.count() == 1


def test_an_event_delivered_twice_writes_one_pair(payment: Payment) -> None:
    deliver_twice(tasks.record_payment, **event_of(payment).payload)
    assert sides() == PAID
    assert ProcessedMessage.objects.filter(consumer=tasks.LEDGER).count() == 1


@pytest.mark.concurrency
def test_an_event_delivered_concurrently_writes_one_pair(payment: Payment) -> None:
    results = deliver_concurrently(tasks.record_payment, times=4, **event_of(payment).payload)
    assert not [result for result in results if isinstance(result, BaseException)], results
    assert sides() == PAID
    assert ProcessedMessage.objects.filter(consumer=tasks.LEDGER).count() == 1


def test_a_relay_sending_the_event_again_writes_nothing_more(payment: Payment) -> None:
    skipped: list[str] = []

    def record(sender: object, *, message_id: str, **kwargs: object) -> None:
        skipped.append(message_id)

    signals.duplicate_skipped.connect(record)
    try:
        with settings_with(OUTBOX_PUBLISHERS=IN_PROCESS_ROUTES), Relay() as relay:
            assert relay.drain().published == 1
            event = event_of(payment)
            assert set(LedgerEntry.objects.values_list("event_id", flat=True)) == {event.event_id}
            # As after a relay that published and died before its ack: the same event again.
            OutboxEvent.objects.filter(pk=event.pk).update(status=OutboxEvent.Status.PENDING)
            assert relay.drain().published == 1
    finally:
        signals.duplicate_skipped.disconnect(record)
    assert skipped == [str(event.event_id)]
    assert sides() == PAID


def test_a_refund_writes_the_reverse_pair_once(payment: Payment) -> None:
    with transaction.atomic():
        services.change_status(payment, Payment.Status.REFUNDED)
    with settings_with(OUTBOX_PUBLISHERS=IN_PROCESS_ROUTES), Relay() as relay:
        assert relay.drain().published == 2
    refund = event_of(payment, services.PAYMENT_REFUNDED)
    assert refund.key == "ledger_a"  # the payment's key: the refund never overtakes it
    # The broker delivering it once more, under its event id:
    tasks.record_refund.apply(kwargs=refund.payload, task_id=str(refund.event_id), throw=True)
    assert sides() == PAID
    assert sides(services.PAYMENT_REFUNDED) == [
        ("credit", "ledger_a", Decimal("30.00")),
        ("debit", "ledger_b", Decimal("30.00")),
    ]


def test_a_consumer_that_fails_leaves_nothing_and_runs_again(payment: Payment) -> None:
    event = event_of(payment)
    broken = {**event.payload, "destination_account": "no_such_account"}
    OutboxEvent.objects.filter(pk=event.pk).update(payload=broken)
    with settings_with(OUTBOX_PUBLISHERS=IN_PROCESS_ROUTES), Relay() as relay:
        # One pass: drain() could claim it again if its jittered backoff came out near zero.
        stats = relay.run_once()
        assert (stats.published, stats.failed) == (0, 1)
        event.refresh_from_db()
        assert "no_such_account" in event.last_error
        # The entries written before the failure rolled back with the marker.
        assert not LedgerEntry.objects.exists()
        assert not ProcessedMessage.objects.exists()
        # Fixed, and due again at once rather than after its backoff.
        OutboxEvent.objects.filter(pk=event.pk).update(
            payload={**broken, "destination_account": "ledger_b"},
            next_attempt_at=event.created_at,
        )
        assert relay.drain().published == 1
    assert sides() == PAID


@override_settings(CELERY_BROKER_URL="", DEMO_FAULTS=True)
def test_a_consumer_fault_needs_a_worker_to_kill(payment: Payment) -> None:
    """In-process, the ledger's "worker" is the web process: the fault is not struck there."""
    event = event_of(payment)
    with settings_with(OUTBOX_PUBLISHERS=IN_PROCESS_ROUTES), Relay() as relay:
        OutboxEvent.objects.filter(pk=event.pk).update(headers={"demo_fault": "crash"})
        assert relay.drain().published == 1
    assert sides() == PAID
