"""State changes an operator makes on outbox events: retry failed events, or discard them.

The admin's actions call these; so can commands and tests. Each works through the selection in
batches, one short transaction per batch, and judges every row again under a row lock before it
changes anything: a relay may have taken the row since the page was shown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import router
from django.db.models import QuerySet

from django_idempotency.db import database_now
from django_idempotency.db.batches import Row, locked_batches
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.publish import kick_after_commit
from django_idempotency.querysets import OutboxStatus, lease_free_q

__all__ = [
    "EVENT_BATCH_SIZE",
    "EventResult",
    "discard",
    "discard_events",
    "retry_dead",
    "retry_events",
]

logger = logging.getLogger(__name__)

EVENT_BATCH_SIZE = 500


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
        now = database_now(using)  # relay leases are the database's, like the relay's own
        batch = OutboxEvent.objects.using(using).filter(pk__in=[row[0] for row in rows])
        in_flight = batch.leased(now).count()
        changed = apply(batch.failed().filter(lease_free_q(now)), now)
        return EventResult(changed, in_flight, len(rows) - changed - in_flight)

    changed = in_flight = not_failed = 0
    for batch in locked_batches(queryset, (), batch_size, change):
        changed += batch.changed
        in_flight += batch.in_flight
        not_failed += batch.not_failed
    return EventResult(changed, in_flight, not_failed)


def _log_count(level: int, message: str, count: int) -> None:
    logger.log(level, message, count, extra={"outbox_count": count})


def retry_dead(queryset: QuerySet[OutboxEvent] | None = None) -> int:
    """Bring DEAD events back to PENDING with a fresh attempt count; returns how many.

    The relay picks them up on its next pass, in their original order: they keep their ids.
    :func:`retry_events` also retries failing PENDING events.
    """
    events = queryset if queryset is not None else OutboxEvent.objects.all()
    return retry_events(events.filter(status=OutboxStatus.DEAD)).changed


def discard(queryset: QuerySet[OutboxEvent]) -> int:
    """Delete DEAD events for good, releasing the events queued behind them on their keys."""
    return discard_events(queryset.filter(status=OutboxStatus.DEAD)).changed
