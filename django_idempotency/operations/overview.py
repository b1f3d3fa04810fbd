"""The last 24 hours, hour by hour: the figures behind the admin's overview page.

Every hour is a bucket by the database's clock (truncated in UTC), the newest one the hour in
progress. Each chart is one grouped query that returns at most a few rows per hour, bounded to
the window by an indexed timestamp:

* the records by ``created_at`` (``django_idempotency_created_idx``, ``db/indexes.py``);
* the events published in the window by ``(status, published_at)`` (the sweep's index), those
  still pending through the relay's index: the backlog, however old;
* failed events and messages by their failure index's entries, which only failing rows have.

Nothing here writes, and nothing on the request path writes for it: a 409 answered to a
duplicate of a request in flight is decided by reading the record and is stored nowhere (see
:func:`conflicts_counted` and docs/operations-admin.md for what the page shows instead).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from django.db import connections, router
from django.db.models import (
    Aggregate,
    BooleanField,
    Case,
    CharField,
    Count,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    Q,
    QuerySet,
    Value,
    When,
)
from django.db.models.functions import TruncHour

from django_idempotency.conf import conf
from django_idempotency.core import leases
from django_idempotency.core.failures import normalise
from django_idempotency.db import database_now, to_datetime
from django_idempotency.db.querysets import ACCEPTED, PROCESSING, OutboxStatus
from django_idempotency.models import FailedMessage, IdempotencyRecord, OutboxEvent
from django_idempotency.operations import failure_groups, health

__all__ = [
    "ConflictCount",
    "FailureHours",
    "GroupHours",
    "HOUR",
    "OUTCOMES",
    "OutboxHours",
    "RecordHours",
    "TOP_GROUPS",
    "WINDOW_HOURS",
    "Window",
    "conflicts_counted",
    "failure_hours",
    "flow_query",
    "held_now",
    "lag_query",
    "outbox_hours",
    "record_hours",
    "records_query",
    "window",
]

#: How many hours the overview shows, the hour in progress included.
WINDOW_HOURS = 24
HOUR = timedelta(hours=1)
#: The failure groups drawn one by one; the others are added up.
TOP_GROUPS = 5

#: What became of the records claimed in an hour, as they stand now: the response stored
#: (``succeeded``: 1xx to 3xx; ``refused``: a 4xx other than 409; ``conflict``: a 409 the view
#: answered itself), handed to a worker (``accepted``), still running (``in_flight``), or held
#: under a lease that ran out (``stuck``). A request that failed (5xx, or an exception) released
#: its key: its record is gone.
OUTCOMES = ("succeeded", "refused", "conflict", "accepted", "in_flight", "stuck")
Outcome = Literal["succeeded", "refused", "conflict", "accepted", "in_flight", "stuck"]


@dataclass(frozen=True, slots=True)
class Window:
    """The hours shown: their starts (UTC, oldest first) and the database's time now."""

    now: datetime
    hours: tuple[datetime, ...]

    @property
    def start(self) -> datetime:
        return self.hours[0]

    def slot(self, moment: datetime | str | None) -> int | None:
        """The index of the hour ``moment`` (an hour's start, as a query returns it) falls in;
        None outside the window."""
        if moment is None:
            return None
        index = int((to_datetime(moment) - self.start) // HOUR)
        return index if 0 <= index < len(self.hours) else None

    def end(self, index: int) -> datetime:
        """When the hour ends; for the hour in progress, now."""
        return min(self.hours[index] + HOUR, self.now)


def window(now: datetime | None = None, hours: int = WINDOW_HOURS) -> Window:
    """The last ``hours`` hours by the database's clock (the records' database)."""
    now = now or database_now(router.db_for_read(IdempotencyRecord))
    now = now.astimezone(UTC)
    top = now.replace(minute=0, second=0, microsecond=0)
    return Window(now, tuple(top - HOUR * back for back in range(hours - 1, -1, -1)))


def _zeros(win: Window) -> list[int]:
    return [0] * len(win.hours)


def _hour(column: str) -> TruncHour:
    return TruncHour(column, tzinfo=UTC)


# --- idempotency records --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordHours:
    """The records claimed in each hour, by what became of them (:data:`OUTCOMES`)."""

    outcomes: Mapping[str, tuple[int, ...]]
    #: Records claimed in the hour whose lease ran out and whose key a retry took over (more
    #: than one attempt): the first request died or overran, and a retry arriving while it
    #: still held the key was answered 409.
    taken_over: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(sum(counts) for counts in self.outcomes.values())


def record_hours(win: Window) -> RecordHours:
    """One grouped query over the records claimed in the window (the ``created_at`` index)."""
    counts = {name: _zeros(win) for name in OUTCOMES}
    over = _zeros(win)
    for row in records_query(win):
        slot = win.slot(row["hour"])
        if slot is None:  # claimed after the database's "now" was read
            continue
        counts[row["outcome"]][slot] += row["records"]
        if row["taken_over"]:
            over[slot] += row["records"]
    return RecordHours({name: tuple(values) for name, values in counts.items()}, tuple(over))


def records_query(win: Window) -> QuerySet[Any, Any]:
    """The records claimed in the window, counted by hour, outcome and whether taken over."""
    outcome = Case(
        When(leases.run_out_q(win.now), then=Value("stuck")),
        When(status=PROCESSING, then=Value("in_flight")),
        When(status=ACCEPTED, then=Value("accepted")),
        When(response_status=409, then=Value("conflict")),
        When(response_status__gte=400, then=Value("refused")),
        default=Value("succeeded"),
        output_field=CharField(),
    )
    taken_over = Case(
        When(attempts__gt=1, then=Value(True)), default=Value(False), output_field=BooleanField()
    )
    return (
        IdempotencyRecord.objects.filter(created_at__gte=win.start)
        .annotate(hour=_hour("created_at"), outcome=outcome, taken_over=taken_over)
        .values("hour", "outcome", "taken_over")
        .annotate(records=Count("*"))
        .order_by()
    )


def held_now(now: datetime) -> health.RowCount:
    """Keys held under a running lease (PROCESSING or ACCEPTED): a retry of any of them is
    answered 409 now. Counted through the lease index, as the health panel counts."""
    return health.count_rows(IdempotencyRecord.objects.lease_active(now))


@dataclass(frozen=True, slots=True)
class ConflictCount:
    """409s answered to duplicates of requests in flight, as Prometheus counts them."""

    value: int
    #: ``"process"``: this server process since it started; ``"host"``: every process sharing
    #: ``PROMETHEUS_MULTIPROC_DIR`` since the directory was emptied.
    scope: Literal["process", "host"]


CONFLICTS_SAMPLE = "django_idempotency_claims_total"


def conflicts_counted() -> ConflictCount | None:
    """The ``django_idempotency_claims_total{outcome="conflicted"}`` counter, where metrics are
    on (``METRICS`` and ``prometheus_client``): the 409s no table records. None otherwise."""
    if not conf.METRICS:
        return None
    try:
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        from django_idempotency.observability import metrics
    except ImportError:
        return None
    labels = {"outcome": "conflicted"}
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        value = registry.get_sample_value(CONFLICTS_SAMPLE, labels)
        return ConflictCount(int(value or 0), "host")
    # This process's counter only: the default registry would also run every collector
    # registered there (the outbox's gauges read the database).
    found = (
        sample.value
        for family in metrics.CLAIMS.collect()
        for sample in family.samples
        if sample.name == CONFLICTS_SAMPLE and sample.labels == labels
    )
    return ConflictCount(int(next(found, 0)), "process")


# --- the outbox -------------------------------------------------------------------------------


class PercentileCont(Aggregate):
    """PostgreSQL's ``percentile_cont(fraction) WITHIN GROUP (ORDER BY expression)``."""

    function = "PERCENTILE_CONT"
    name = "PercentileCont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"

    def __init__(self, expression: Any, fraction: float, **extra: Any) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError("fraction must be between 0 and 1")
        super().__init__(expression, fraction=repr(float(fraction)), **extra)


@dataclass(frozen=True, slots=True)
class OutboxHours:
    """The outbox hour by hour."""

    #: PENDING events at each hour's end (the last: now), as far as the rows still tell: those
    #: pending now and written by then, and those published or gone DEAD after it.
    backlog: tuple[int, ...]
    #: Events published in each hour.
    published: tuple[int, ...]
    #: Events that went DEAD in each hour (their last failure), and are DEAD still.
    dead: tuple[int, ...]
    #: From ``publish()`` (its transaction commits right after) to the broker's acceptance, over
    #: the events published in each hour; None for an hour that published none. The median and
    #: the 95th percentile only on PostgreSQL (None elsewhere).
    lag_p50: tuple[timedelta | None, ...]
    lag_p95: tuple[timedelta | None, ...]
    lag_max: tuple[timedelta | None, ...]
    #: Whether this database computes percentiles (PostgreSQL).
    percentiles: bool

    @property
    def empty(self) -> bool:
        return not (any(self.backlog) or any(self.published) or any(self.dead))


def outbox_hours(win: Window) -> OutboxHours:
    """Two grouped queries: the flow (backlog, published, dead), and the lag."""
    backlog, published, dead = _outbox_flow(win)
    p50, p95, longest, percentiles = _outbox_lag(win)
    return OutboxHours(backlog, published, dead, p50, p95, longest, percentiles)


def flow_query(win: Window) -> QuerySet[Any, Any]:
    """Every event that was pending at some moment of the window: pending now (through the
    relay's index, however old: the backlog), published in the window (the sweep's index), or
    gone DEAD in it. Grouped by the hour it was written (None: before the window), the hour it
    left the backlog (None: it has not) and its status."""
    start = win.start
    events = OutboxEvent.objects.filter(
        Q(status__in=(OutboxStatus.PENDING, OutboxStatus.HELD))
        | Q(status=OutboxStatus.PUBLISHED, published_at__gte=start)
        | Q(status=OutboxStatus.DEAD, last_failed_at__gte=start)
    )
    return (
        events.annotate(
            written=Case(
                When(created_at__lt=start, then=Value(None)),
                default=_hour("created_at"),
                output_field=DateTimeField(),
            ),
            left=Case(
                When(status=OutboxStatus.PUBLISHED, then=_hour("published_at")),
                When(status=OutboxStatus.DEAD, then=_hour("last_failed_at")),
                default=Value(None),
                output_field=DateTimeField(),
            ),
        )
        .values("written", "left", "status")
        .annotate(events=Count("*"))
        .order_by()
    )


def _outbox_flow(win: Window) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    hours = len(win.hours)
    # entering[k]: events that joined the backlog in hour k (-1: before the window, at 0);
    # leaving[k]: events that left it in hour k.
    entering, leaving = [0] * hours, [0] * hours
    published, dead = [0] * hours, [0] * hours
    for row in flow_query(win):
        written = 0 if row["written"] is None else win.slot(row["written"])
        if written is None:  # written after the database's "now" was read
            continue
        gone = win.slot(row["left"]) if row["left"] is not None else None
        entering[written] += row["events"]
        if gone is not None:
            leaving[gone] += row["events"]
            left = published if row["status"] == OutboxStatus.PUBLISHED else dead
            left[gone] += row["events"]
    backlog, level = [], 0
    for index in range(hours):
        level += entering[index] - leaving[index]
        backlog.append(max(level, 0))
    return tuple(backlog), tuple(published), tuple(dead)


def lag_query(win: Window) -> QuerySet[Any, Any]:
    """The events published in the window, by the hour they were published (the sweep's
    ``(status, published_at)`` index): the longest lag, and on PostgreSQL the median and the
    95th percentile."""
    events = OutboxEvent.objects.published().filter(published_at__gte=win.start)
    lag = ExpressionWrapper(F("published_at") - F("created_at"), output_field=DurationField())
    aggregates: dict[str, Any] = {"longest": Max("lag")}
    if connections[events.db].vendor == "postgresql":
        aggregates["p50"] = PercentileCont("lag", 0.5, output_field=DurationField())
        aggregates["p95"] = PercentileCont("lag", 0.95, output_field=DurationField())
    return (
        events.annotate(hour=_hour("published_at"), lag=lag)
        .values("hour")
        .annotate(**aggregates)
        .order_by()
    )


def _outbox_lag(
    win: Window,
) -> tuple[
    tuple[timedelta | None, ...], tuple[timedelta | None, ...], tuple[timedelta | None, ...], bool
]:
    rows = lag_query(win)
    percentiles = "p50" in rows.query.annotations
    found: dict[str, list[timedelta | None]] = {
        name: [None] * len(win.hours) for name in ("p50", "p95", "longest")
    }
    for row in rows:
        slot = win.slot(row["hour"])
        if slot is None:
            continue
        for name in found:
            value = cast("timedelta | None", row.get(name))
            found[name][slot] = max(value, timedelta(0)) if value is not None else None
    return tuple(found["p50"]), tuple(found["p95"]), tuple(found["longest"]), percentiles


# --- failure groups ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupHours:
    """One failure group's failures in each hour."""

    kind: Literal["event", "message"]
    fingerprint: str
    #: The newest failure's error, normalised: what the group's rows have in common.
    signature: str
    failures: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.failures)


@dataclass(frozen=True, slots=True)
class FailureHours:
    """Failing events and messages by the hour of their latest failure, per failure group:
    the :data:`TOP_GROUPS` groups with the most in the window, and the rest added up."""

    groups: tuple[GroupHours, ...]
    other: tuple[int, ...]
    #: How many groups failed in each hour.
    groups_per_hour: tuple[int, ...]
    #: How many groups failed in the window.
    groups_seen: int = 0

    @property
    def empty(self) -> bool:
        return not any(self.groups_per_hour)


def failure_hours(win: Window, *, messages: bool = True, top: int = TOP_GROUPS) -> FailureHours:
    """One grouped query per table over the failure index's entries (a published or retried
    event has none): failing events, and (``messages``) failed messages, whose latest failure
    fell in the window. A row that fails again moves to the hour of its latest failure."""
    sources: list[tuple[Literal["event", "message"], Any]] = [
        ("event", OutboxEvent.objects.filter(failure_fingerprint__isnull=False))
    ]
    if messages:
        sources.append(("message", FailedMessage.objects.all()))
    counts: dict[tuple[Literal["event", "message"], str], list[int]] = defaultdict(
        lambda: _zeros(win)
    )
    for kind, rows in sources:
        grouped = (
            rows.filter(last_failed_at__gte=win.start)
            .annotate(hour=_hour("last_failed_at"))
            .values("failure_fingerprint", "hour")
            .annotate(failures=Count("*"))
            .order_by()
        )
        for row in grouped:
            slot = win.slot(row["hour"])
            if slot is not None:
                counts[kind, row["failure_fingerprint"]][slot] += row["failures"]
    ranked = sorted(counts.items(), key=lambda item: (-sum(item[1]), item[0]))
    groups = [
        GroupHours(kind, fingerprint, _signature(kind, fingerprint), tuple(values))
        for (kind, fingerprint), values in ranked[:top]
    ]
    other = _zeros(win)
    for _, values in ranked[top:]:
        for index, value in enumerate(values):
            other[index] += value
    per_hour = [
        sum(1 for values in counts.values() if values[index]) for index in range(len(win.hours))
    ]
    return FailureHours(tuple(groups), tuple(other), tuple(per_hour), len(counts))


def _signature(kind: Literal["event", "message"], fingerprint: str) -> str:
    rows = OutboxEvent.objects.all() if kind == "event" else FailedMessage.objects.all()
    newest = failure_groups.newest_failure(rows, fingerprint)
    return normalise(newest["last_error"]) if newest else fingerprint
