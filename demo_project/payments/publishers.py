"""The demo's publisher when there is no broker: the consumer task runs right here.

Without ``CELERY_BROKER_URL`` the relay runs inside the web process (the default kick queues the
relay task, which Celery's eager mode runs in the kick's background thread after the commit).
Eager mode does not cover ``send_task``, which CeleryPublisher uses, so this publisher hands each
event to its task as a worker would: the event id as the task id, the payload as keyword
arguments. A task that fails is a failed publish, retried by the relay with backoff.
"""

from __future__ import annotations

from django.utils.module_loading import import_string

from django_idempotency.exceptions import PublishError
from django_idempotency.publishers.base import OutboxMessage, Publisher


class InProcessTaskPublisher(Publisher):
    """``OPTIONS``: ``task``, the dotted path of the task (imported on first use, since a web
    process does not autodiscover tasks as a worker does)."""

    def __init__(self, *, task: str) -> None:
        super().__init__()
        self.task = task

    def publish(self, message: OutboxMessage) -> None:
        result = import_string(self.task).apply(
            kwargs=message.payload,
            task_id=str(message.event_id),
            headers=dict(message.headers),
            throw=False,
        )
        if result.failed():
            raise PublishError(f"{self.task} failed: {result.result!r}")
