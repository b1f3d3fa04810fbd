"""The ledger consumer: one idempotent Celery task per payment event.

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

from typing import Any

from celery import shared_task

from demo_project.payments import faults, services
from django_idempotency.inbox import idempotent_consumer

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
