"""What an operator does to the app's rows, from the admin, a command or a script: release
idempotency keys, retry or discard outbox events (one by one or a whole failure group), forget
the records of failed messages.

Each action works through the selection in batches, one short transaction per batch, and judges
every row again under a row lock before it changes anything: the page an operator acted on may
be minutes old, and a request or a relay may have taken the row since. Each is logged and
announced by its signal (``key_released``, ``events_retried``, ``events_discarded``,
``failures_forgotten``) once its last batch committed; the metrics count those signals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from django.db import router
from django.db.models import Q, QuerySet

from django_idempotency import signals
from django_idempotency.core import leases
from django_idempotency.db import database_now
from django_idempotency.db.batches import Row, locked_batches
from django_idempotency.db.querysets import OutboxEventQuerySet, OutboxStatus, lease_free_q
from django_idempotency.models import FailedMessage, IdempotencyRecord, OutboxEvent
from django_idempotency.outbox import holding
from django_idempotency.outbox.publish import kick_after_commit

__all__ = [
    "EVENT_BATCH_SIZE",
    "EventResult",
    "FORGET_BATCH_SIZE",
    "FailureGroupSelection",
    "RELEASE_BATCH_SIZE",
    "ReleaseResult",
    "discard",
    "discard_events",
    "discard_failure_group",
    "forget_failed_messages",
    "release_records",
    "retry_dead",
    "retry_events",
    "retry_failure_group",
]

logger = logging.getLogger(__name__)


# --- idempotency records -----------------------------------------------------------------------

#: Rows locked and changed per transaction, so acting on "all 200,000 stuck keys" never holds
#: one long transaction or a lock on every row at once.
RELEASE_BATCH_SIZE = 500


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
    after its batch commits, which is when the Redis copy deletes its own entry.
    """

    def release(using: str, rows: list[Row]) -> tuple[list[Row], int]:
        # Judged as the row is now, not as the admin page showed it: a stuck key may have been
        # taken over by a retry since, and is then running again.
        now = database_now(using)  # leases are the database's, whatever this machine's clock says
        chosen = [row for row in rows if force or not leases.running(row[3], row[4], now)]
        IdempotencyRecord.objects.using(using).filter(pk__in=[row[0] for row in chosen]).delete()
        return chosen, len(rows) - len(chosen)

    released = refused = 0
    fields = ("scope", "key", "status", "lease_expires_at")
    for chosen, left in locked_batches(queryset, fields, batch_size, release):
        released += len(chosen)
        refused += left
        for _pk, scope, key, _status, _lease in chosen:
            signals.key_released.send(sender=IdempotencyRecord, scope=scope, key=key, reason=reason)
    return ReleaseResult(released=released, refused=refused)


# --- outbox events ---------------------------------------------------------------------------

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
    #: Events selected, but found no longer matching once locked: a failure group's event that
    #: meanwhile failed for another reason, say.
    not_matching: int = 0


@dataclass(frozen=True, slots=True)
class FailureGroupSelection:
    """The failed events of one failure group, or a filtered part of it.

    ``seen_at`` (the database's time when the operator saw the group) leaves out the events
    that joined the group after it: an action then only touches what the operator was shown.
    Events fingerprinted by the upgrade, whose failure time is unknown, count as seen.
    """

    fingerprint: str
    #: Only the events with this topic.
    topic: str | None = None
    #: Only the DEAD events, or only those waiting for a retry.
    state: Literal["dead", "retrying"] | None = None
    seen_at: datetime | None = None

    def matching(self) -> Q:
        """The selection as a filter, judged again under each row's lock."""
        match = Q(failure_fingerprint=self.fingerprint)
        if self.topic is not None:
            match &= Q(topic=self.topic)
        if self.state == "dead":
            match &= Q(status=OutboxStatus.DEAD)
        elif self.state == "retrying":
            match &= Q(status=OutboxStatus.PENDING)
        if self.seen_at is not None:
            match &= Q(failing_since__lte=self.seen_at) | Q(failing_since__isnull=True)
        return match

    def events(self, using: str | None = None) -> OutboxEventQuerySet:
        """The failed events of the selection, now."""
        events = OutboxEvent.objects.using(using or router.db_for_read(OutboxEvent))
        return events.failed().filter(self.matching())


def retry_events(
    queryset: QuerySet[OutboxEvent],
    *,
    batch_size: int = EVENT_BATCH_SIZE,
    matching: Q | None = None,
) -> EventResult:
    """Send failed events again now: back to PENDING, attempts reset, due at once.

    They keep their id and their place in the order, so the events queued behind them on their
    key follow; they leave their failure group. The relay is kicked once the change commits.
    ``matching``, a filter the events must still pass once locked, leaves alone (and counts in
    ``not_matching``) the selected events that changed meanwhile.
    """
    return _retry(queryset, batch_size, matching, failure_group=None)


def discard_events(
    queryset: QuerySet[OutboxEvent],
    *,
    batch_size: int = EVENT_BATCH_SIZE,
    matching: Q | None = None,
) -> EventResult:
    """Delete failed events for good; the events queued behind them on their key go next.

    ``matching`` as for :func:`retry_events`.
    """
    return _discard(queryset, batch_size, matching, failure_group=None)


def retry_failure_group(
    selection: FailureGroupSelection, *, batch_size: int = EVENT_BATCH_SIZE
) -> EventResult:
    """:func:`retry_events` for a failure group (or the part ``selection`` names)."""
    return _retry(
        selection.events(), batch_size, selection.matching(), failure_group=selection.fingerprint
    )


def discard_failure_group(
    selection: FailureGroupSelection, *, batch_size: int = EVENT_BATCH_SIZE
) -> EventResult:
    """:func:`discard_events` for a failure group (or the part ``selection`` names)."""
    return _discard(
        selection.events(), batch_size, selection.matching(), failure_group=selection.fingerprint
    )


def _retry(
    queryset: QuerySet[OutboxEvent],
    batch_size: int,
    matching: Q | None,
    failure_group: str | None,
) -> EventResult:
    def retry(events: QuerySet[OutboxEvent], now: datetime) -> int:
        return events.update(
            status=OutboxStatus.PENDING,
            attempts=0,
            next_attempt_at=now,
            locked_until=None,
            relay_token=None,
            failure_fingerprint=None,
            failing_since=None,
            failure_kind=None,
        )

    result = _change_failed_events(queryset, batch_size, retry, matching)
    _log_count(logging.INFO, "outbox: %d failed events queued for retry", result, failure_group)
    signals.events_retried.send(
        sender=OutboxEvent, count=result.changed, failure_group=failure_group
    )
    if result.changed:
        kick_after_commit(router.db_for_write(OutboxEvent))
    return result


def _discard(
    queryset: QuerySet[OutboxEvent],
    batch_size: int,
    matching: Q | None,
    failure_group: str | None,
) -> EventResult:
    def discard(events: QuerySet[OutboxEvent], now: datetime) -> int:
        return events.delete()[0]

    result = _change_failed_events(queryset, batch_size, discard, matching)
    _log_count(logging.WARNING, "outbox: %d failed events discarded", result, failure_group)
    signals.events_discarded.send(
        sender=OutboxEvent, count=result.changed, failure_group=failure_group
    )
    return result


def _change_failed_events(
    queryset: QuerySet[OutboxEvent],
    batch_size: int,
    apply: Callable[[QuerySet[OutboxEvent], datetime], int],
    matching: Q | None,
) -> EventResult:
    def change(using: str, rows: list[Row]) -> EventResult:
        # The rows are locked: a relay's claim skips them (SKIP LOCKED) and its ack waits for
        # this commit. A running lease means a relay is between claim and ack; changing the
        # row under it would let another relay send the event while the first one does.
        now = database_now(using)  # relay leases are the database's, like the relay's own
        batch = OutboxEvent.objects.using(using).filter(pk__in=[row[0] for row in rows])
        not_matching = 0
        if matching is not None:
            # Judged on the locked row: no one can move it out of the selection any more.
            batch = batch.filter(matching)
            not_matching = len(rows) - batch.count()
        in_flight = batch.leased(now).count()
        changing = batch.failed().filter(lease_free_q(now))
        keys = set(changing.exclude(key="").values_list("key", flat=True))
        changed = apply(changing, now)
        # Retried or gone, the failed events hold nothing back: the events set aside behind
        # them go back to PENDING in this transaction (outbox/holding.py).
        holding.release(OutboxEvent.objects.using(using), keys)
        not_failed = len(rows) - not_matching - changed - in_flight
        return EventResult(changed, in_flight, not_failed, not_matching)

    total = EventResult()
    for batch in locked_batches(queryset, (), batch_size, change):
        total = EventResult(
            total.changed + batch.changed,
            total.in_flight + batch.in_flight,
            total.not_failed + batch.not_failed,
            total.not_matching + batch.not_matching,
        )
    return total


def _log_count(level: int, message: str, result: EventResult, failure_group: str | None) -> None:
    if not result.changed:
        return
    extra = {"outbox_count": result.changed, "outbox_failure_group": failure_group}
    logger.log(level, message, result.changed, extra=extra)


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


# --- records of failed messages ----------------------------------------------------------------

#: Records locked and deleted per transaction.
FORGET_BATCH_SIZE = 500


def forget_failed_messages(
    queryset: QuerySet[FailedMessage],
    *,
    batch_size: int = FORGET_BATCH_SIZE,
    failure_group: str | None = None,
) -> int:
    """Delete the selected records of failed messages, in locked batches; returns how many.

    ``failure_group`` (a fingerprint) only labels the signal and the log line: pass it when the
    selection is a failure group. ``failures_forgotten`` is sent once the last batch committed.
    """

    def forget(using: str, rows: list[Row]) -> int:
        deleted, _ = FailedMessage.objects.using(using).filter(pk__in=[r[0] for r in rows]).delete()
        return deleted

    forgotten = sum(locked_batches(queryset, (), batch_size, forget))
    if forgotten:
        logger.info(
            "inbox: %d failed messages forgotten",
            forgotten,
            extra={"inbox_count": forgotten, "inbox_failure_group": failure_group},
        )
    signals.failures_forgotten.send(
        sender=FailedMessage, count=forgotten, failure_group=failure_group
    )
    return forgotten
