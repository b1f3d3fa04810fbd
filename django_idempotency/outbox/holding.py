"""Events set aside behind a failed earlier event of their key (HELD), so claims never read them.

Per-key order holds every later event of a key while its earliest unpublished event is DEAD or
waits for a retry. Left PENDING, those events sit in the claim's path: each claim reads them,
finds them blocked and goes on, so a claim's cost grew with everything queued behind failed keys
(half a second per claim with 99,000 such events on PostgreSQL, on every pass of every relay).
HELD events are outside the range of PENDING events the relay index gives the claim, so a claim
costs the same however many wait.

HELD is a hint, never what keeps the order: the claim's per-key checks count a HELD event as an
earlier unpublished one, as they count a PENDING one, so setting an event back to PENDING is
always safe. Only setting one aside needs care, because a HELD event nobody releases waits for
ever:

* events are set aside (only behind a failed event that is DEAD or waits at least
  ``HOLD_AFTER_SECONDS`` for its retry) in the transaction that records it (ack.py), or by
  :func:`tend` under the lock of the failed event's row, so no relay can publish that event
  and release its key in between;
* the transaction that publishes a once-failed event, or retries or discards a failed one
  (``operations/actions.py``), releases its key's HELD events;
* :func:`tend`, which each relay runs about once a minute, sets aside the events that arrived
  behind failed ones since, and releases HELD events with no failed event before them (one
  deleted by hand, say).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import Min, OuterRef, Q

from django_idempotency.db.querysets import (
    OutboxEventQuerySet,
    OutboxStatus,
    earlier_unpublished,
    lease_free_q,
)
from django_idempotency.models import OutboxEvent

__all__ = ["KeyChanges", "release", "set_aside", "tend"]

#: A failed event whose retry is at least this far away (seconds), or that is DEAD, has the
#: events behind it set aside. A shorter wait keeps them PENDING: the claims that read them until
#: the retry cost less than setting them aside and releasing them again, which writes every
#: event behind the failed one twice (one failure in ten, retried within a second, drained 3 x
#: slower that way).
HOLD_AFTER_SECONDS = 5.0
#: Keys per statement, so a batch that failed on many keys stays a few short statements.
_KEYS_PER_STATEMENT = 100
#: Failed events whose keys one tend looks at; the next tend takes the rest.
_TEND_HEADS = 1000


def set_aside(outbox: OutboxEventQuerySet, heads: Mapping[str, int], now: datetime) -> int:
    """HELD: the PENDING, unleased events of ``outbox`` queued behind ``heads`` (each key's
    failed event, by id). The caller holds the failed events' rows (their ack's transaction,
    or their lock), so none of them can be published before this commits."""
    count = 0
    items = sorted(heads.items())
    for start in range(0, len(items), _KEYS_PER_STATEMENT):
        behind = Q()
        for key, pk in items[start : start + _KEYS_PER_STATEMENT]:
            behind |= Q(key=key, pk__gt=pk)
        count += (
            outbox.filter(behind, lease_free_q(now), status=OutboxStatus.PENDING)
            .order_by()
            .update(status=OutboxStatus.HELD)
        )
    return count


def release(outbox: OutboxEventQuerySet, keys: Iterable[str]) -> int:
    """PENDING again: the HELD events of ``keys``. Always safe: the claim keeps their order."""
    count = 0
    ordered = sorted({key for key in keys if key})
    for start in range(0, len(ordered), _KEYS_PER_STATEMENT):
        chunk = ordered[start : start + _KEYS_PER_STATEMENT]
        count += (
            outbox.filter(key__in=chunk, status=OutboxStatus.HELD)
            .order_by()
            .update(status=OutboxStatus.PENDING)
        )
    return count


@dataclass(slots=True)
class KeyChanges:
    """What a batch's acknowledgement does to the events behind its keys, in its transaction:
    the keys whose once-failed event went out are released, and the events behind each event
    that failed now are set aside."""

    released: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    @classmethod
    def after(
        cls,
        sent: Iterable[OutboxEvent],
        failed: Iterable[tuple[OutboxEvent, Mapping[str, Any]]],
        now: datetime,
    ) -> KeyChanges:
        """For a batch's ``sent`` events and its ``failed`` ones with their changes."""
        waits_long = _waits_long(now)
        return cls(
            # Only an event that failed before can have events set aside behind it: a retried
            # one released its key when it was retried (attempts back to 0).
            released={event.pk: event.key for event in sent if event.key and event.attempts},
            failed={
                event.pk: event.key
                for event, changes in failed
                if event.key
                and (
                    changes["status"] == OutboxStatus.DEAD
                    or changes["next_attempt_at"] >= waits_long
                )
            },
        )

    def __bool__(self) -> bool:
        return bool(self.released or self.failed)

    def apply(self, outbox: OutboxEventQuerySet, owned: set[int], now: datetime) -> None:
        """For the events this relay still held (``owned``): their acknowledgement counts."""
        release(outbox, (key for pk, key in self.released.items() if pk in owned))
        heads: dict[str, int] = {}
        for pk, key in self.failed.items():
            if pk in owned:
                heads[key] = min(pk, heads.get(key, pk))
        if heads:
            set_aside(outbox, heads, now)


def _waits_long(now: datetime) -> datetime:
    return now + timedelta(seconds=HOLD_AFTER_SECONDS)


def _locked(failed: OutboxEventQuerySet, using: str) -> OutboxEventQuerySet:
    """``failed``, locked until the tend commits: such an event cannot be claimed (SKIP LOCKED)
    or retried meanwhile, so its key cannot be released before the events set aside behind it
    are. (SQLite takes one writer at a time.)"""
    features = connections[using].features
    if not features.has_select_for_update:
        return failed
    return failed.select_for_update(skip_locked=features.has_select_for_update_skip_locked)


@dataclass(frozen=True, slots=True)
class Tended:
    set_aside: int
    released: int


def tend(outbox: OutboxEventQuerySet, now: datetime) -> Tended:
    """Set aside what arrived behind failed events since they failed, and release HELD events
    that no failed event holds any more.

    Both read only failed events and HELD ones (the failure index, the index of unpublished
    events by key), never the PENDING backlog."""
    using = outbox.db
    with transaction.atomic(using=using):
        failed = (
            outbox.failed()
            .exclude(key="")
            .filter(lease_free_q(now), failure_fingerprint__isnull=False)
            .filter(Q(status=OutboxStatus.DEAD) | Q(next_attempt_at__gte=_waits_long(now)))
            .order_by()
        )
        heads: dict[str, int] = {}
        for key, pk in _locked(failed, using).values_list("key", "pk")[:_TEND_HEADS]:
            heads[key] = min(pk, heads.get(key, pk))
        aside = set_aside(outbox, heads, now)
    # A key whose first HELD event has no PENDING or DEAD event before it holds nothing back:
    # its failed event is gone. Releasing is always safe, so this needs no lock.
    holder = outbox.filter(
        key=OuterRef("key"), status__in=(OutboxStatus.PENDING, OutboxStatus.DEAD)
    )
    firsts = outbox.held().order_by().values("key").annotate(first=Min("pk")).values("first")
    orphaned = (
        outbox.filter(pk__in=firsts)
        .exclude(earlier_unpublished(holder, OuterRef("pk")))
        .values_list("key", flat=True)
    )
    released = release(outbox, list(orphaned))
    return Tended(aside, released)
