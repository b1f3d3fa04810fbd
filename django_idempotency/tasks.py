"""Celery tasks: thin wrappers over the plain functions the management commands call too.

Every task is ``acks_late`` (a worker that dies mid-task leaves the message to be redelivered)
and safe to run concurrently with itself: relays coordinate through leases, sweeps through
re-checked deletes. The module imports without Celery; the functions then stay plain functions.

Merge :data:`BEAT_SCHEDULE` into ``CELERY_BEAT_SCHEDULE``; django-celery-beat's
``DatabaseScheduler`` reads that setting too.
"""

from __future__ import annotations

import logging
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
    from django_idempotency.relay import Relay

    with Relay(batch_size=batch_size) as relay:
        return relay.drain(max_batches=max_batches).as_dict()


@_task
def sweep_idempotency_records(batch_size: int | None = None) -> int:
    from django_idempotency.sweeps import sweep_expired_records

    return sweep_expired_records(batch_size=batch_size)


@_task
def sweep_outbox_events(batch_size: int | None = None) -> int:
    from django_idempotency.sweeps import sweep_published_events

    return sweep_published_events(batch_size=batch_size)


@_task
def sweep_processed_messages(batch_size: int | None = None) -> int:
    from django_idempotency.sweeps import sweep_processed_messages as sweep

    return sweep(batch_size=batch_size)


def kick_relay(using: str) -> None:
    """The default ``OUTBOX_KICK``: queue a relay task right after a publishing commit.

    ``retry=False`` so a broker outage costs the request nothing but a log line; the relay
    entry in :data:`BEAT_SCHEDULE` sends the event later. ``expires`` drops kicks that queued up
    while no worker ran: one relay pass serves them all.
    """
    if _shared_task is None:  # pragma: no cover
        return
    relay_outbox.apply_async(  # type: ignore[attr-defined]
        retry=False, expires=max(conf.OUTBOX_RELAY_LEASE_SECONDS, 60)
    )


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
