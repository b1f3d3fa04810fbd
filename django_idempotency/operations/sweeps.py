"""Deleting what no longer matters, in bounded batches: the tasks and the command call these.

Each batch is one SELECT of at most ``batch_size`` primary keys and one DELETE of those keys that
re-applies the sweep's condition, each its own short transaction. The re-check matters: a row
that changed between the two (an expired key claimed again) is left alone. A sweep killed
half-way keeps what it did: the batches it deleted stay deleted (and counted: each sends
``rows_swept`` after its DELETE), and the next run starts over on what is left.

A sweep holds a session lock of its own while it runs (PostgreSQL and MariaDB/MySQL, with
``TAKE_OVER_DEAD_OWNERS``, which says session locks are safe on the connection): a run that
starts while the previous one still holds the work (a big first purge slower than its interval)
skips at once and returns None, instead of two sweeps racing over the same rows. The lock ends
with the session, so a sweep whose worker was killed holds nothing. Without it, concurrent sweeps
are still correct: the second DELETE of a batch finds nothing left.

Age is judged by the database's clock, as claims judge it, unless the caller passes ``now``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.db import models, router
from django.db.models import QuerySet

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.db import database_now, session_locks
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage

__all__ = [
    "PROGRESS_EVERY_BATCHES",
    "SWEEPS",
    "sweep_expired_records",
    "sweep_processed_messages",
    "sweep_published_events",
]

logger = logging.getLogger(__name__)

#: A sweep of several batches logs its progress at INFO after its first batch and then every
#: this many batches (the others at DEBUG), so a sweep killed half-way has said how far it got.
PROGRESS_EVERY_BATCHES = 10


def sweep_expired_records(
    *, batch_size: int | None = None, now: datetime | None = None, dry_run: bool = False
) -> int | None:
    """Delete idempotency records past their TTL; returns how many (would be) deleted, or None
    when it skipped its run because the previous sweep still runs.

    A partitioned records table (``RECORD_PARTITIONS``) is left to retention, which drops whole
    partitions (``operations/partitions.py``): deleting row by row is the WAL, vacuum and bloat
    the partitions exist to avoid. Claims treat an expired record as absent either way.
    """
    if _left_to_retention("records", "idempotency_records"):
        return 0
    return _sweep(
        IdempotencyRecord,
        "idempotency_records",
        lambda events, at: events.expired(at),
        batch_size=batch_size,
        now=now,
        dry_run=dry_run,
    )


def _left_to_retention(label: str, sweep: str) -> bool:
    """Whether the table is partitioned, so retention drops its partitions instead."""
    from django_idempotency.operations.partitions import LAYOUTS, is_partitioned

    layout = LAYOUTS[label]
    if not is_partitioned(layout.using(), layout):
        return False
    logger.debug(
        "swept nothing: the %s table is partitioned; retention drops its partitions",
        label,
        extra={"sweep": sweep, "sweep_count": 0, "sweep_batches": 0},
    )
    return True


def sweep_published_events(
    *, batch_size: int | None = None, now: datetime | None = None, dry_run: bool = False
) -> int | None:
    """Delete events published more than ``OUTBOX_RETENTION_SECONDS`` ago; a partitioned
    outbox (``OUTBOX_PARTITIONS``) is left to retention, as the records are."""
    if _left_to_retention("outbox", "outbox_events"):
        return 0
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
) -> int | None:
    """Delete consumer markers older than ``INBOX_RETENTION_SECONDS``; a partitioned inbox
    (``INBOX_PARTITIONS``) is left to retention."""
    if _left_to_retention("inbox", "processed_messages"):
        return 0
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
SWEEPS: dict[str, Callable[..., int | None]] = {
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
) -> int | None:
    batch_size = batch_size or conf.SWEEP_BATCH_SIZE
    using = router.db_for_write(model)
    now = now or database_now(using)
    rows = model._default_manager.using(using).all()
    if dry_run:
        return due(rows, now).count()
    with session_locks.sweep(using, name) as held:
        if not held:
            logger.info(
                "skipped the %s sweep: the previous one still holds the work",
                name,
                extra={"sweep": name, "sweep_count": 0, "sweep_batches": 0, "sweep_skipped": True},
            )
            return None
        return _delete(model, name, due, rows, now, batch_size)


def _delete(
    model: type[models.Model],
    name: str,
    due: Callable[[Any, datetime], QuerySet[Any]],
    rows: QuerySet[Any],
    now: datetime,
    batch_size: int,
) -> int:
    total = batches = 0
    while True:
        ids = list(due(rows, now).order_by("pk").values_list("pk", flat=True)[:batch_size])
        if not ids:
            break
        # Outside a transaction the DELETE commits at once: a sweep killed after this line has
        # still done (and, through the signal, counted) this batch.
        deleted, _ = due(rows.filter(pk__in=ids), now).delete()
        total += deleted
        batches += 1
        if deleted:
            signals.rows_swept.send(sender=model, count=deleted, sweep=name)
        if len(ids) < batch_size:
            break
        _log_progress(name, batches, deleted, total)
    extra = {"sweep": name, "sweep_count": total, "sweep_batches": batches}
    if total:
        logger.info("swept %d %s", total, name, extra=extra)
    else:
        logger.debug("swept nothing: no %s due", name, extra=extra)
    return total


def _log_progress(name: str, batch: int, deleted: int, total: int) -> None:
    level = logging.INFO if (batch - 1) % PROGRESS_EVERY_BATCHES == 0 else logging.DEBUG
    logger.log(
        level,
        "sweeping %s: batch %d deleted %d, %d so far",
        name,
        batch,
        deleted,
        total,
        extra={"sweep": name, "sweep_count": total, "sweep_batches": batch},
    )
