"""Celery without a broker: what the worker and beat do, done inside the web process.

Without ``CELERY_BROKER_URL`` the demo runs tasks in-process (Celery's eager mode). The default
kick then runs the relay task in the kick's background thread after each publishing commit, and:

* :class:`InProcessTaskPublisher` hands each event to its consumer task right there, as a worker
  would run it (eager mode does not cover ``send_task``, which CeleryPublisher uses);
* :func:`start_relay_beat` kicks the relay every few seconds, as beat's relay entry does, so
  events whose kick was lost, or whose relay died with its process mid-batch (the tour's crash
  can kill a web worker while it relays), go out once their lease has expired.
"""

from __future__ import annotations

import threading
import time

from django.db import DEFAULT_DB_ALIAS
from django.utils.module_loading import import_string

from django_idempotency.conf import conf
from django_idempotency.exceptions import PublishError
from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.tasks import BEAT_SCHEDULE

#: As often as beat's relay entry runs it.
RELAY_INTERVAL_SECONDS = float(BEAT_SCHEDULE["django-idempotency-relay-outbox"]["schedule"])


class InProcessTaskPublisher(Publisher):
    """Runs the event's task here and now: the event id as the task id, the payload as keyword
    arguments. A task that fails is a failed publish, which the relay retries with backoff.

    ``OPTIONS``: ``task``, the dotted path of the task (imported on first use: a web process
    does not autodiscover tasks as a worker does).
    """

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


def start_relay_beat(interval: float = RELAY_INTERVAL_SECONDS) -> threading.Thread:
    """Kick the relay every ``interval`` seconds from a daemon thread of this process."""

    def run() -> None:
        while True:
            time.sleep(interval)
            kick = conf.OUTBOX_KICK
            if kick is not None:
                kick(DEFAULT_DB_ALIAS)

    thread = threading.Thread(target=run, name="demo-relay-beat", daemon=True)
    thread.start()
    return thread
