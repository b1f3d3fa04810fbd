"""State changes an operator makes. The admin's actions call these; so can commands and tests.

Each works through the selection in batches, one short transaction per batch, and judges every
row again under a row lock before it changes anything: the page an operator acted on may be
minutes old, and a request or a relay may have taken the row since.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from django.db import router, transaction
from django.db.models import Model, QuerySet
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord, OutboxEvent
from django_idempotency.outbox import kick_after_commit
from django_idempotency.querysets import PROCESSING, OutboxStatus, lease_free_q

logger = logging.getLogger(__name__)

#: Rows locked and changed per transaction, so acting on "all 200,000 stuck keys" never holds
#: one long transaction or a lock on every row at once.
RELEASE_BATCH_SIZE = 500
EVENT_BATCH_SIZE = 500

T = TypeVar("T")
Row = tuple[Any, ...]


def _locked_batches(
    queryset: QuerySet[Any],
    fields: Sequence[str],
    batch_size: int,
    change: Callable[[str, list[Row]], T],
) -> Iterator[T]:
    """Call ``change(using, rows)`` per batch of ``(pk, *fields)`` rows, locked, in pk order.

    Each batch is its own transaction, committed before its result is yielded, so whatever the
    caller does with a result (send signals, say) happens after the commit.
    """
    model: type[Model] = queryset.model
    using = router.db_for_write(model)
    candidates = queryset.using(using).order_by("pk")
    last_pk: Any = None
    while True:
        with transaction.atomic(using=using):
            batch = candidates if last_pk is None else candidates.filter(pk__gt=last_pk)
            rows = list(batch.select_for_update().values_list("pk", *fields)[:batch_size])
            if not rows:
                return
            result = change(using, rows)
        last_pk = rows[-1][0]
        yield result


# --- idempotency records -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    #: Records deleted; ``key_released`` was sent for each.
    released: int = 0
    #: Records left alone because a request's lease on them is still running.
    refused: int = 0


def release_records(
    queryset: QuerySet[IdempotencyRecord],
    *,
    force: bool = False,
    reason: str = "admin",
    batch_size: int = RELEASE_BATCH_SIZE,
) -> ReleaseResult:
    """Delete the selected records so their keys can be used again.

    Stuck (PROCESSING, lease expired) and COMPLETED records are released. A record whose lease
    is still running belongs to a request that may still be working on it: it is refused unless
    ``force``. Forcing never lets work happen twice: that request's completion finds no record
    (the fencing token check), rolls its writes back and answers 409; the client's retry then
    runs once. Releasing a COMPLETED record, by contrast, means the client's next retry runs the
    request again: that is what an operator asks for when the stored response was wrong.

    Each released record is announced with ``key_released`` (``reason="admin"`` by default)
    after its batch commits, which is when the Redis fast path deletes its own entry.
    """

    def release(using: str, rows: list[Row]) -> tuple[list[Row], int]:
        # Judged as the row is now, not as the admin page showed it: a stuck key may have been
        # taken over by a retry since, and is then running again.
        now = timezone.now()
        chosen = [row for row in rows if force or not _lease_running(row[3], row[4], now)]
        IdempotencyRecord.objects.using(using).filter(pk__in=[row[0] for row in chosen]).delete()
        return chosen, len(rows) - len(chosen)

    released = refused = 0
    fields = ("scope", "key", "status", "lease_expires_at")
    for chosen, left in _locked_batches(queryset, fields, batch_size, release):
        released += len(chosen)
        refused += left
        for _pk, scope, key, _status, _lease in chosen:
            signals.key_released.send(sender=IdempotencyRecord, scope=scope, key=key, reason=reason)
    return ReleaseResult(released=released, refused=refused)


def _lease_running(status: str, lease_expires_at: datetime | None, now: datetime) -> bool:
    return status == PROCESSING and lease_expires_at is not None and lease_expires_at > now


# --- outbox events -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EventResult:
    """What an action on outbox events did. Only *failed* events are changed: DEAD ones, and
    PENDING ones with a failed attempt that no relay is publishing right now."""

    #: Events retried or discarded.
    changed: int = 0
    #: PENDING events a relay holds a lease on: it may be publishing them this very moment.
    in_flight: int = 0
    #: Events that have not failed: published, or pending with no failed attempt yet.
    not_failed: int = 0


def retry_events(
    queryset: QuerySet[OutboxEvent], *, batch_size: int = EVENT_BATCH_SIZE
) -> EventResult:
    """Send failed events again now: back to PENDING, attempts reset, due at once.

    They keep their id and their place in the order, so the events queued behind them on their
    key follow. The relay is kicked once the change commits.
    """

    def retry(events: QuerySet[OutboxEvent], now: datetime) -> int:
        return events.update(
            status=OutboxStatus.PENDING,
            attempts=0,
            next_attempt_at=now,
            locked_until=None,
            relay_token=None,
        )

    result = _change_failed_events(queryset, batch_size, retry)
    if result.changed:
        _log_count(logging.INFO, "outbox: %d failed events queued for retry", result.changed)
        kick_after_commit(router.db_for_write(OutboxEvent))
    return result


def discard_events(
    queryset: QuerySet[OutboxEvent], *, batch_size: int = EVENT_BATCH_SIZE
) -> EventResult:
    """Delete failed events for good; the events queued behind them on their key go next."""

    def discard(events: QuerySet[OutboxEvent], now: datetime) -> int:
        return events.delete()[0]

    result = _change_failed_events(queryset, batch_size, discard)
    if result.changed:
        _log_count(logging.WARNING, "outbox: %d failed events discarded", result.changed)
    return result


def _change_failed_events(
    queryset: QuerySet[OutboxEvent],
    batch_size: int,
    apply: Callable[[QuerySet[OutboxEvent], datetime], int],
) -> EventResult:
    def change(using: str, rows: list[Row]) -> EventResult:
        # The rows are locked: a relay's claim skips them (SKIP LOCKED) and its ack waits for
        # this commit. A running lease means a relay is between claim and ack; changing the
        # row under it would let another relay send the event while the first one does.
        now = timezone.now()
        batch = OutboxEvent.objects.using(using).filter(pk__in=[row[0] for row in rows])
        in_flight = batch.leased(now).count()
        changed = apply(batch.failed().filter(lease_free_q(now)), now)
        return EventResult(changed, in_flight, len(rows) - changed - in_flight)

    changed = in_flight = not_failed = 0
    for batch in _locked_batches(queryset, (), batch_size, change):
        changed += batch.changed
        in_flight += batch.in_flight
        not_failed += batch.not_failed
    return EventResult(changed, in_flight, not_failed)


def _log_count(level: int, message: str, count: int) -> None:
    logger.log(level, message, count, extra={"outbox_count": count})
