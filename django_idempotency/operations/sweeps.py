"""Deleting what no longer matters, in bounded batches: the tasks and the command call these.

Each batch is one SELECT of at most ``batch_size`` primary keys and one DELETE of those keys that
re-applies the sweep's condition, each its own short transaction. The re-check matters: a row
that changed between the two (an expired key claimed again) is left alone. Concurrent sweeps are
harmless: the second DELETE of a batch finds nothing left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.db import models, router
from django.db.models import QuerySet
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage

__all__ = ["SWEEPS", "sweep_expired_records", "sweep_processed_messages", "sweep_published_events"]

logger = logging.getLogger(__name__)


def sweep_expired_records(
    *, batch_size: int | None = None, now: datetime | None = None, dry_run: bool = False
) -> int:
    """Delete idempotency records past their TTL; returns how many (would be) deleted."""
    return _sweep(
        IdempotencyRecord,
        "idempotency_records",
        lambda events, at: events.expired(at),
        batch_size=batch_size,
        now=now,
        dry_run=dry_run,
    )


def sweep_published_events(
    *, batch_size: int | None = None, now: datetime | None = None, dry_run: bool = False
) -> int:
    """Delete events published more than ``OUTBOX_RETENTION_SECONDS`` ago."""
    retention = timedelta(seconds=conf.OUTBOX_RETENTION_SECONDS)
    return _sweep(
        OutboxEvent,
        "outbox_events",
        lambda events, at: events.published_before(at - retention),
        batch_size=batch_size,
        now=now,
        dry_run=dry_run,
    )


def sweep_processed_messages(
    *, batch_size: int | None = None, now: datetime | None = None, dry_run: bool = False
) -> int:
    """Delete consumer markers older than ``INBOX_RETENTION_SECONDS``."""
    retention = timedelta(seconds=conf.INBOX_RETENTION_SECONDS)
    return _sweep(
        ProcessedMessage,
        "processed_messages",
        lambda messages, at: messages.processed_before(at - retention),
        batch_size=batch_size,
        now=now,
        dry_run=dry_run,
    )


#: Every sweep by name, in the order the command runs them.
SWEEPS: dict[str, Callable[..., int]] = {
    "records": sweep_expired_records,
    "events": sweep_published_events,
    "messages": sweep_processed_messages,
}


def _sweep(
    model: type[models.Model],
    name: str,
    due: Callable[[Any, datetime], QuerySet[Any]],
    *,
    batch_size: int | None,
    now: datetime | None,
    dry_run: bool,
) -> int:
    batch_size = batch_size or conf.SWEEP_BATCH_SIZE
    now = now or timezone.now()
    rows = model._default_manager.using(router.db_for_write(model)).all()
    if dry_run:
        return due(rows, now).count()
    total = 0
    while True:
        ids = list(due(rows, now).order_by("pk").values_list("pk", flat=True)[:batch_size])
        if not ids:
            break
        deleted, _ = due(rows.filter(pk__in=ids), now).delete()
        total += deleted
        if deleted:
            signals.rows_swept.send(sender=model, count=deleted, sweep=name)
        if len(ids) < batch_size:
            break
    if total:
        logger.info("swept %d %s", total, name, extra={"sweep": name, "sweep_count": total})
    return total
