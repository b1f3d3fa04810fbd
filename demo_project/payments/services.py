"""What the API and the ledger consumer do, in plain functions.

The views call ``create_payment`` and ``change_status`` inside the idempotent transaction; each
publishes its event through the outbox in that same transaction, so the event exists exactly
when the change does. The ledger tasks (tasks.py) call ``post_to_ledger`` once per event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import F
from rest_framework.exceptions import ValidationError

from demo_project.payments.faults import Fault
from demo_project.payments.models import Account, LedgerEntry, Payment
from django_idempotency.outbox import publish

PAYMENT_COMPLETED = "payment.completed"
PAYMENT_REFUNDED = "payment.refunded"

#: Namespace of the demo's event ids (uuid5 of topic and payment).
EVENT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:django-idempotency:demo:payments")


def event_id(topic: str, payment: Payment) -> uuid.UUID:
    """The id of ``topic``'s event about ``payment``: the same wherever it is computed.

    A payment completes once and is refunded at most once, so this names exactly one event:
    anything publishing it a second time fails on the outbox's unique event id instead of
    sending a duplicate, and anyone holding the payment can find its event.
    """
    return uuid.uuid5(EVENT_NAMESPACE, f"{topic}:{payment.transaction_id}")


def create_payment(
    *,
    amount: Decimal,
    currency: str,
    source: Account,
    destination: Account,
    fault: Fault | None = None,
) -> Payment:
    """Move the money, record the payment and publish ``payment.completed``, all or nothing."""
    _move(amount, source, destination)
    payment = Payment.objects.create(
        amount=amount, currency=currency, source_account=source, destination_account=destination
    )
    _publish(PAYMENT_COMPLETED, payment, fault)
    if fault is not None:
        fault.strike()
    return payment


def change_status(payment: Payment, status: str, *, fault: Fault | None = None) -> Payment:
    """Refund (money goes back, ``payment.refunded`` is published) or dispute a payment."""
    if payment.status != Payment.Status.COMPLETED:
        raise ValidationError({"status": [f"A {payment.status} payment cannot change status."]})
    if status == Payment.Status.REFUNDED:
        _move(payment.amount, payment.destination_account, payment.source_account)
    payment.status = status
    payment.save(update_fields=["status"])
    if status == Payment.Status.REFUNDED:
        _publish(PAYMENT_REFUNDED, payment, fault)
    if fault is not None:
        fault.strike()
    return payment


def _publish(topic: str, payment: Payment, fault: Fault | None) -> None:
    # Both events of a payment take its source account as their key: events about one account
    # leave in the order they were committed, and a refund never overtakes its payment.
    publish(
        topic,
        {
            "transaction_id": str(payment.transaction_id),
            "amount": str(payment.amount),
            "currency": payment.currency,
            "source_account": payment.source_account.name,
            "destination_account": payment.destination_account.name,
        },
        key=payment.source_account.name,
        event_id=event_id(topic, payment),
        headers=fault.event_headers if fault is not None else None,
    )


def post_to_ledger(*, event_id: str, topic: str, payment: Mapping[str, str]) -> list[LedgerEntry]:
    """Write the two sides of one event's movement, from the event's payload.

    ``payment.completed`` debits the source and credits the destination; ``payment.refunded``
    moves the money back. Called by the ledger consumer inside its transaction, after its
    processed-message marker: a redelivered event never gets here twice.
    """
    debit, credit = payment["source_account"], payment["destination_account"]
    if topic == PAYMENT_REFUNDED:
        debit, credit = credit, debit
    accounts = Account.objects.in_bulk([debit, credit], field_name="name")
    movement = Payment.objects.get(transaction_id=payment["transaction_id"])
    sides = [(debit, LedgerEntry.Side.DEBIT), (credit, LedgerEntry.Side.CREDIT)]
    # InnoDB checks each entry's foreign key with a shared lock on its account row, which
    # conflicts with a payment's update of that row (PostgreSQL's KEY SHARE lock does not).
    # Inserting in primary-key order takes those locks in the order _move() takes its own, so a
    # payment and a ledger posting between the same accounts cannot deadlock on MariaDB.
    sides.sort(key=lambda side: accounts[side[0]].pk)
    return LedgerEntry.objects.bulk_create(
        [
            LedgerEntry(
                payment=movement,
                event_id=event_id,
                topic=topic,
                account=accounts[name],
                side=side,
                amount=Decimal(payment["amount"]),
                currency=payment["currency"],
            )
            for name, side in sides
        ]
    )


def _move(amount: Decimal, source: Account, destination: Account) -> None:
    # Both rows are updated in primary-key order, so two payments in opposite directions between
    # the same accounts take their row locks in the same order and cannot deadlock. The debit is
    # conditional: the balance check and the update are one statement, so no race can overdraw.
    for account in sorted((source, destination), key=lambda account: account.pk):
        if account.pk == source.pk:
            debited = Account.objects.filter(pk=source.pk, balance__gte=amount).update(
                balance=F("balance") - amount
            )
            if not debited:
                raise ValidationError({"amount": [f"{source.name} has insufficient funds."]})
        else:
            Account.objects.filter(pk=destination.pk).update(balance=F("balance") + amount)


def transfer_at_bank(reference: str, payout: Mapping[str, Any]) -> None:
    """The demo's stand-in for a bank's API: it takes ``DEMO_PAYOUT_SECONDS``. A real bank
    deduplicates on ``reference``, the same for every delivery of one payout."""
    time.sleep(settings.DEMO_PAYOUT_SECONDS)
