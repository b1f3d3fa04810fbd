"""Celery tasks: thin wrappers over the plain functions the management commands call too.

Every task is ``acks_late`` (a worker that dies mid-task leaves the message to be redelivered)
and safe to run concurrently with itself: relays coordinate through leases, sweeps through
re-checked deletes. The module imports without Celery; the functions then stay plain functions.

Merge :data:`BEAT_SCHEDULE` into ``CELERY_BEAT_SCHEDULE``; django-celery-beat's
``DatabaseScheduler`` reads that setting too.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from django_idempotency.conf import conf

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

try:
    from celery import shared_task as _shared_task
except ImportError:  # pragma: no cover - exercised only without Celery installed
    _shared_task = None


def _task(func: F) -> F:
    if _shared_task is None:  # pragma: no cover
        return func
    task: F = _shared_task(acks_late=True, ignore_result=False)(func)
    return task


@_task
def relay_outbox(batch_size: int | None = None, max_batches: int = 50) -> dict[str, int]:
    """Publish due outbox events until none are left (or ``max_batches``)."""
    from django_idempotency.outbox.relay import Relay

    with Relay(batch_size=batch_size) as relay:
        return relay.drain(max_batches=max_batches).as_dict()


@_task
def sweep_idempotency_records(batch_size: int | None = None) -> int:
    from django_idempotency.operations.sweeps import sweep_expired_records

    return sweep_expired_records(batch_size=batch_size)


@_task
def sweep_outbox_events(batch_size: int | None = None) -> int:
    from django_idempotency.operations.sweeps import sweep_published_events

    return sweep_published_events(batch_size=batch_size)


@_task
def sweep_processed_messages(batch_size: int | None = None) -> int:
    from django_idempotency.operations.sweeps import sweep_processed_messages as sweep

    return sweep(batch_size=batch_size)


class _RelayKicker:
    """Queues relay tasks from a daemon thread, so a commit never waits on the broker.

    Kicks that arrive while a task is being queued collapse into one more: a burst of commits
    costs two relay tasks, not one per commit. The thread starts on first use in each process
    (after a fork too); a kick lost at exit is picked up by the periodic relay.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._wanted = threading.Event()
        #: Set while the thread waits for a kick (tests wait on it).
        self.idle = threading.Event()

    def kick(self) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._wanted, self.idle = threading.Event(), threading.Event()
                thread = threading.Thread(
                    target=self._run, args=(self._wanted, self.idle), daemon=True
                )
                thread.name = "django-idempotency-relay-kick"
                thread.start()
            self.idle.clear()
            self._wanted.set()

    @staticmethod
    def _run(wanted: threading.Event, idle: threading.Event) -> None:
        while True:
            if not wanted.is_set():
                idle.set()
            wanted.wait()
            wanted.clear()
            try:
                relay_outbox.apply_async(  # type: ignore[attr-defined]
                    retry=False, expires=max(conf.OUTBOX_RELAY_LEASE_SECONDS, 60)
                )
            except Exception:
                logger.warning("outbox relay kick failed", exc_info=True)


_kicker = _RelayKicker()


def kick_relay(using: str) -> None:
    """The default ``OUTBOX_KICK``: queue a relay task soon after a publishing commit.

    ``retry=False``: a broker outage costs a log line, and the relay entry of
    :data:`BEAT_SCHEDULE` sends the event later. ``expires`` drops kicks that queued up while no
    worker ran: one relay pass serves them all.
    """
    if _shared_task is None:  # pragma: no cover
        return
    _kicker.kick()


#: Ready to merge: ``CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE, ...}``. Seconds between runs.
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "django-idempotency-relay-outbox": {
        "task": "django_idempotency.tasks.relay_outbox",
        "schedule": 10.0,
    },
    "django-idempotency-sweep-records": {
        "task": "django_idempotency.tasks.sweep_idempotency_records",
        "schedule": 3600.0,
    },
    "django-idempotency-sweep-outbox": {
        "task": "django_idempotency.tasks.sweep_outbox_events",
        "schedule": 3600.0,
    },
    "django-idempotency-sweep-inbox": {
        "task": "django_idempotency.tasks.sweep_processed_messages",
        "schedule": 3600.0,
    },
}
