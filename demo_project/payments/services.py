"""What the API does, in plain functions the views call inside the idempotent transaction."""

from __future__ import annotations

from decimal import Decimal

from django.db.models import F
from rest_framework.exceptions import ValidationError

from demo_project.payments.faults import Fault
from demo_project.payments.models import Account, Payment


def create_payment(
    *,
    amount: Decimal,
    currency: str,
    source: Account,
    destination: Account,
    fault: Fault | None = None,
) -> Payment:
    """Move the money and record the payment; the caller's transaction makes it all or nothing.

    This is where the ``payment.completed`` event is published through the outbox, in the same
    transaction, so the event exists exactly when the payment does.
    """
    _move(amount, source, destination)
    payment = Payment.objects.create(
        amount=amount, currency=currency, source_account=source, destination_account=destination
    )
    if fault is not None:
        fault.strike()
    return payment


def change_status(payment: Payment, status: str, *, fault: Fault | None = None) -> Payment:
    """Refund (money goes back) or dispute a completed payment."""
    if payment.status != Payment.Status.COMPLETED:
        raise ValidationError({"status": [f"A {payment.status} payment cannot change status."]})
    if status == Payment.Status.REFUNDED:
        _move(payment.amount, payment.destination_account, payment.source_account)
    payment.status = status
    payment.save(update_fields=["status"])
    if fault is not None:
        fault.strike()
    return payment


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
