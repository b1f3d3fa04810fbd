"""Tasks the consumer tests deliver: each creates a Widget, so counting widgets counts effects."""

from __future__ import annotations

from celery import shared_task

from django_idempotency.inbox import idempotent_consumer
from django_idempotency.outbox import publish
from tests.testapp.models import Widget


class HandlerFailed(RuntimeError):
    pass


@shared_task(acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer
def record_effect(name: str, **extra: object) -> int:
    return Widget.objects.create(name=name).pk


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer
def record_effect_bound(self: object, name: str) -> int:
    return Widget.objects.create(name=name).pk


@shared_task(acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer(message_id_arg="message_id", consumer="by-argument")
def record_with_argument(name: str, message_id: str) -> int:
    return Widget.objects.create(name=name).pk


@shared_task(acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer
def record_and_publish(name: str) -> list[str]:
    Widget.objects.create(name=name)
    events = [publish("widgets.created", {"name": name, "n": n}) for n in range(2)]
    return [str(event.event_id) for event in events]


@shared_task(acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer
def fail_after_writing(name: str) -> None:
    Widget.objects.create(name=name)
    raise HandlerFailed(name)
