"""The ledger consumer: one idempotent Celery task per payment event; and the payout worker.

The outbox sends each event as its task, with the event id as the task id (CeleryPublisher with
a broker; demo_project/payments/inprocess.py in-process without one), and the event's payload
as keyword arguments. ``@idempotent_consumer`` records that id in the task's transaction before
the entries are written, so a redelivery, a relay sending the event again, or a worker killed
mid-task never writes a second pair.

``acks_late`` and ``reject_on_worker_lost``: the message is acknowledged only once the task has
finished, and put back on the queue when the worker process running it dies, so a crash loses
nothing; the marker makes the redelivery a no-op if the first run had committed.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from celery import shared_task
from django.http import HttpResponse, JsonResponse
from rest_framework.exceptions import ValidationError

from demo_project.payments import faults, services
from demo_project.payments.models import Account
from demo_project.payments.serializers import PaymentSerializer
from django_idempotency.inbox import idempotent_consumer
from django_idempotency.request.handoff import handed_off, lease_of

#: The consumer name under which both tasks record the events they handled.
LEDGER = "ledger"


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer(consumer=LEDGER)
def record_payment(self: Any, **payment: str) -> None:
    """``payment.completed``: debit the source, credit the destination."""
    _record(self, services.PAYMENT_COMPLETED, payment)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer(consumer=LEDGER)
def record_refund(self: Any, **payment: str) -> None:
    """``payment.refunded``: credit the source, debit the destination."""
    _record(self, services.PAYMENT_REFUNDED, payment)


def _record(task: Any, topic: str, payment: dict[str, str]) -> None:
    # The task id is the event id: both publishers send it so.
    services.post_to_ledger(event_id=task.request.id, topic=topic, payment=payment)
    faults.strike_consumer(task.request)


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
def send_payout(self: Any, **payout: Any) -> str:
    """A payout handed off by ``POST /api/v1/payouts/`` (202): the slow part first, outside
    any transaction, then the money moves and the final response is stored, once.

    The bank transfer is slow (``DEMO_PAYOUT_SECONDS``) and stands for a call to another
    service: it runs again on a redelivery, so a real one would send the bank a key derived
    from the request's (``lease_of(payout).derived_key("bank")``), as ``docs/howto/
    side-effects.md`` shows. ``record_payout`` runs in the transaction that stores the final
    response: a redelivery of a completed payout runs nothing there.
    """
    services.transfer_at_bank(lease_of(payout).derived_key("bank"), payout)
    return record_payout(**payout)


@handed_off
def record_payout(**payout: str) -> HttpResponse:
    """Move the money and answer as ``POST /api/v1/payments/`` would have: 201 and the payment,
    or the refusal (400) when the source cannot pay any more: also a final answer."""
    try:
        payment = services.create_payment(
            amount=Decimal(payout["amount"]),
            currency=payout["currency"],
            source=Account.objects.get(name=payout["source_account"]),
            destination=Account.objects.get(name=payout["destination_account"]),
        )
    except ValidationError as exc:
        return JsonResponse(exc.detail, status=400, safe=False)
    return JsonResponse(PaymentSerializer(payment).data, status=201)
