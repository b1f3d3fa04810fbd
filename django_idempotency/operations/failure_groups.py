"""Failure groups: failed outbox events and failed messages grouped by what went wrong.

An outage fails thousands of events for one reason; an operator wants that reason once, with a
count and one traceback, not thousands of rows. A group is the rows that share a failure
fingerprint (``core/failures.py``). These are the queries behind the admin's failure groups
pages, in plain Python, so that a command or a script sees the groups an operator sees. Every
one reads the failure index's entries of failing rows only, however large the table; the
changes themselves (requeue, discard) are in :mod:`django_idempotency.operations.actions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from django.db import router
from django.db.models import Count, F, Q

from django_idempotency.core.failures import normalise
from django_idempotency.db import database_now
from django_idempotency.db.querysets import (
    FailedMessageQuerySet,
    OutboxEventQuerySet,
    OutboxStatus,
)
from django_idempotency.models import FailedMessage, OutboxEvent
from django_idempotency.operations.actions import FailureGroupSelection

__all__ = [
    "FailedMessageGroup",
    "FailureGroup",
    "GroupCounts",
    "GroupState",
    "count",
    "event_groups",
    "joined_since_seen",
    "message_groups",
    "newest_failure",
    "newest_first",
    "seen_now",
    "topics",
]

#: A part of a group: its DEAD events, or those waiting for a retry.
GroupState = Literal["dead", "retrying"]


@dataclass(frozen=True, slots=True)
class FailureGroup:
    """A failure group of outbox events: the aggregate, and the group's newest failure."""

    fingerprint: str
    #: The newest failure's ``last_error``, normalised: what the group's events have in common.
    signature: str
    events: int
    dead: int
    topics: int
    #: The first topic by name (the only one when ``topics`` is 1).
    topic: str
    first_seen: datetime | None
    last_seen: datetime | None
    newest: Mapping[str, Any]

    @property
    def retrying(self) -> int:
        return self.events - self.dead


@dataclass(frozen=True, slots=True)
class FailedMessageGroup:
    """A failure group of the consumers' failed messages."""

    fingerprint: str
    signature: str
    messages: int
    consumers: int
    #: The first consumer by name (the only one when ``consumers`` is 1).
    consumer: str
    first_seen: datetime | None
    last_seen: datetime | None
    newest: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class GroupCounts:
    """How many failed events a selection holds, and how many of them are DEAD (the others
    wait for a retry)."""

    events: int
    dead: int


def newest_failure(
    rows: OutboxEventQuerySet | FailedMessageQuerySet, fingerprint: str
) -> dict[str, Any] | None:
    """The group's most recent failure (an event's or a message's): one probe at the end of the
    group's range of the failure index."""
    group = rows.in_failure_group(fingerprint)
    fields = ["pk", "last_error", "failure_traceback", "last_failed_at"]
    if group.model is OutboxEvent:
        fields += ["event_id", "topic", "failure_kind"]
    else:
        fields += ["consumer", "message_id"]
    newest = group.filter(last_failed_at__isnull=False).order_by("-last_failed_at")
    for candidates in (newest, group.order_by("-pk")):  # the latter: fingerprinted by the upgrade
        row: dict[str, Any] | None = candidates.values(*fields).first()
        if row is not None:
            return row
    return None


def event_groups(
    topic: str | None, state: GroupState | None, *, offset: int, limit: int
) -> tuple[list[FailureGroup], bool]:
    """A page of the failed events' groups, seen most recently first, and whether more follow.

    ``topic`` and ``state`` (``dead`` or ``retrying``) narrow the events grouped. One row more
    than ``limit`` is read to tell whether a next page exists without counting the groups.
    """
    events = _failed_events(topic, state)
    rows = list(events.failure_groups()[offset : offset + limit + 1])
    groups = []
    for row in rows[:limit]:
        group = _event_group(events, row)
        if group is not None:
            groups.append(group)
    return groups, len(rows) > limit


def message_groups(*, limit: int) -> list[FailedMessageGroup]:
    """The first ``limit`` groups of failed messages, seen most recently first."""
    failed = FailedMessage.objects.all()
    groups = []
    for row in failed.failure_groups()[:limit]:
        newest = newest_failure(failed, row["failure_fingerprint"])
        if newest is None:  # the group emptied between the two reads
            continue
        groups.append(
            FailedMessageGroup(
                fingerprint=row["failure_fingerprint"],
                signature=normalise(newest["last_error"]),
                messages=row["messages"],
                consumers=row["consumers"],
                consumer=row["consumer"],
                first_seen=row["first_seen"],
                last_seen=row["last_seen"],
                newest=newest,
            )
        )
    return groups


def topics(chosen: str | None, *, sample_size: int) -> list[str]:
    """The topics to filter the groups by: those of a sample of grouped failed events (a
    DISTINCT over all of them would read every failed event, of which an outage makes many),
    and the chosen one."""
    grouped = OutboxEvent.objects.failed().filter(failure_fingerprint__isnull=False)
    found = set(grouped.order_by().values_list("topic", flat=True)[:sample_size])
    if chosen:
        found.add(chosen)
    return sorted(found)


def seen_now() -> datetime:
    """The moment a group is shown, for :attr:`FailureGroupSelection.seen_at`: the database's
    time, the clock that stamps ``failing_since``, so that an action confirmed later leaves out
    the events that joined the group after the operator looked."""
    return database_now(router.db_for_write(OutboxEvent))


def count(selection: FailureGroupSelection) -> GroupCounts:
    """What a confirmation page states before an operator requeues or discards: one aggregate
    over the selection's entries of the failure index."""
    counts = selection.events().aggregate(
        events=Count("pk"), dead=Count("pk", filter=Q(status=OutboxStatus.DEAD))
    )
    return GroupCounts(events=counts["events"], dead=counts["dead"])


def newest_first(selection: FailureGroupSelection) -> OutboxEventQuerySet:
    """The selection's events, the most recently failed first; those fingerprinted by the
    upgrade, whose failure time is unknown, last."""
    return selection.events().order_by(F("last_failed_at").desc(nulls_last=True), "-pk")


def joined_since_seen(selection: FailureGroupSelection) -> int:
    """How many events joined the group (or its part) after ``selection.seen_at``: an action
    left them alone, and the operator should hear of them."""
    whole = FailureGroupSelection(selection.fingerprint, selection.topic, selection.state)
    return whole.events().filter(failing_since__gt=selection.seen_at).count()


def _failed_events(topic: str | None, state: GroupState | None) -> OutboxEventQuerySet:
    events = OutboxEvent.objects.failed()
    if topic:
        events = events.filter(topic=topic)
    if state:
        dead = state == "dead"
        events = events.filter(status=OutboxStatus.DEAD if dead else OutboxStatus.PENDING)
    return events


def _event_group(events: OutboxEventQuerySet, row: Mapping[str, Any]) -> FailureGroup | None:
    fingerprint = row["failure_fingerprint"]
    newest = newest_failure(events, fingerprint)
    if newest is None:  # the group emptied between the two reads
        return None
    return FailureGroup(
        fingerprint=fingerprint,
        signature=normalise(newest["last_error"]),
        events=row["events"],
        dead=row["dead"],
        topics=row["topics"],
        topic=row["topic"],
        first_seen=row["first_seen"],
        last_seen=row["last_seen"],
        newest=newest,
    )
