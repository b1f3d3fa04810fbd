"""Health at a glance: the figures an operator needs first, cheap on tables of millions of rows.

PostgreSQL keeps no row count, so an exact ``COUNT(*)`` reads the whole table (or index): too
slow to run on every admin page load. Every figure here counts at most ``COUNT_LIMIT`` rows,
through an index; past that, PostgreSQL's planner estimate stands in ("~1,000,000"), and other
databases show a lower bound ("10,000+"). The numbers an operator acts on (stuck keys, dead
events) are small when things are healthy, so they are exact exactly when it matters most.

Each part of the app contributes a section function to :data:`SECTIONS`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from django.db import connections, models, router
from django.db.models import Count, Min, Q
from django.utils.formats import number_format
from django.utils.timesince import timesince
from django.utils.translation import gettext as _

from django_idempotency.conf import conf
from django_idempotency.core.failures import FailureKind
from django_idempotency.db import database_now
from django_idempotency.db.querysets import OutboxStatus, RecordStatus
from django_idempotency.models import IdempotencyRecord, OutboxEvent

__all__ = [
    "COUNT_LIMIT",
    "Figure",
    "OLDEST_PENDING_SAMPLE",
    "OutboxHealth",
    "RowCount",
    "SECTIONS",
    "Section",
    "count_rows",
    "elapsed",
    "outbox_health",
    "outbox_section",
    "planner_estimate",
    "records_section",
    "snapshot",
]

#: Exact counts stop here; what lies beyond is estimated (PostgreSQL) or shown as "10,000+".
COUNT_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class RowCount:
    value: int
    kind: Literal["exact", "estimate", "at_least"]

    def __str__(self) -> str:
        number = number_format(self.value, force_grouping=True)
        if self.kind == "estimate":
            return f"~{number}"
        if self.kind == "at_least":
            return f"{number}+"
        return number


def count_rows(queryset: models.QuerySet[Any], limit: int | None = None) -> RowCount:
    """Count up to ``limit`` (default ``COUNT_LIMIT``) rows exactly; above it, estimate."""
    limit = COUNT_LIMIT if limit is None else limit
    # COUNT(*) over a LIMITed subquery: the database stops reading after limit + 1 rows.
    counted = queryset.order_by()[: limit + 1].count()
    if counted <= limit:
        return RowCount(counted, "exact")
    estimate = planner_estimate(queryset)
    if estimate is not None:
        return RowCount(max(estimate, limit + 1), "estimate")
    return RowCount(limit, "at_least")


def planner_estimate(queryset: models.QuerySet[Any]) -> int | None:
    """The planner's row estimate for the query (PostgreSQL only; None elsewhere).

    It comes from the statistics ANALYZE (or autovacuum) keeps, costs no table read, and is
    usually within a few percent for the equality and range filters used here.
    """
    if connections[queryset.db].vendor != "postgresql":
        return None
    plan = json.loads(queryset.order_by().explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])


@dataclass(frozen=True, slots=True)
class Figure:
    label: str
    value: str
    #: Changelist query string showing the rows behind the figure, if any.
    query: str = ""
    #: Draws the operator's eye: something waits for a person.
    alert: bool = False


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    #: The model whose admin changelist the figures' queries apply to.
    model: type[models.Model]
    figures: tuple[Figure, ...]


def elapsed(start: datetime | None, end: datetime) -> str:
    """Time from start to end for a person: "42 s", "3 minutes", "2 days"."""
    if start is None:
        return "–"
    if end - start < timedelta(minutes=1):
        return _("%(seconds)d s") % {"seconds": max(0, (end - start).total_seconds())}
    return timesince(start, end, depth=1)


def records_section(now: datetime) -> Section:
    records = IdempotencyRecord.objects.all()
    stuck = records.stuck(now)
    stuck_count = count_rows(stuck)
    # MIN over the (status, lease_expires_at) index: one index probe, not a scan.
    stuck_since = stuck.aggregate(oldest=Min("lease_expires_at"))["oldest"]
    return Section(
        title=_("Idempotency keys"),
        model=IdempotencyRecord,
        figures=(
            Figure(
                _("processing"),
                str(count_rows(records.processing())),
                f"status__exact={RecordStatus.PROCESSING}",
            ),
            Figure(
                _("completed"),
                str(count_rows(records.completed())),
                f"status__exact={RecordStatus.COMPLETED}",
            ),
            Figure(_("stuck"), str(stuck_count), "stuck=yes", alert=stuck_count.value > 0),
            Figure(_("stuck for"), elapsed(stuck_since, now), "stuck=yes", alert=bool(stuck_since)),
            Figure(
                _("expired, awaiting sweep"), str(count_rows(records.expired(now))), "expired=yes"
            ),
        ),
    )


#: The oldest pending event is looked for among this many at the head of the relay's order.
OLDEST_PENDING_SAMPLE = 100


@dataclass(frozen=True, slots=True)
class OutboxHealth:
    """The outbox figures the panel and the Prometheus gauges (metrics.py) share."""

    #: PENDING events: the backlog the relay still has to send.
    pending: RowCount
    #: When the oldest PENDING event was written; None when there is none.
    oldest_pending_at: datetime | None
    #: DEAD events, waiting for a person.
    dead: RowCount
    #: HELD events: queued behind a failed event of their key (outbox/holding.py).
    held: RowCount
    #: PENDING events whose latest attempt failed on a configuration error (the broker refused
    #: the route: credentials, permissions, a missing stream or exchange; or no route), among
    #: the first ``COUNT_LIMIT`` in the relay's order: a lower bound when more are pending.
    configuration_errors: RowCount


def outbox_health(using: str | None = None) -> OutboxHealth:
    """Four bounded reads through the relay index, whatever the table's size.

    The oldest pending event is the oldest among the first ``OLDEST_PENDING_SAMPLE`` in the
    relay's order (id order): that order follows creation closely (it is creation order apart
    from transactions that overlap), and a ``MIN(created_at)`` over every pending event would
    read the whole backlog, which is large exactly when someone looks.
    """
    events = OutboxEvent.objects.using(using).all() if using else OutboxEvent.objects.all()
    pending = events.pending()
    head = pending.in_relay_order().values_list("created_at", flat=True)
    # Counted over a LIMITed subquery in the relay's order: the index's first rows, no more.
    head_kinds = pending.in_relay_order()[:COUNT_LIMIT].aggregate(
        configuration=Count("pk", filter=Q(failure_kind=FailureKind.CONFIGURATION)),
        read=Count("pk"),
    )
    return OutboxHealth(
        pending=count_rows(pending),
        oldest_pending_at=min(head[:OLDEST_PENDING_SAMPLE], default=None),
        dead=count_rows(events.dead()),
        held=count_rows(events.held()),
        configuration_errors=RowCount(
            head_kinds["configuration"],
            "at_least" if head_kinds["read"] >= COUNT_LIMIT else "exact",
        ),
    )


def outbox_section(now: datetime) -> Section:
    outbox = outbox_health()
    oldest = outbox.oldest_pending_at
    # A running relay sends an event within a pass; one waiting longer than a whole relay lease
    # means no relay runs, or publishing keeps failing.
    late = oldest is not None and now - oldest > timedelta(seconds=conf.OUTBOX_RELAY_LEASE_SECONDS)
    pending_query = f"status__exact={OutboxStatus.PENDING}"
    return Section(
        title=_("Outbox"),
        model=OutboxEvent,
        figures=(
            Figure(_("pending"), str(outbox.pending), pending_query),
            Figure(_("oldest pending"), elapsed(oldest, now), pending_query, alert=late),
            Figure(
                _("dead"),
                str(outbox.dead),
                f"status__exact={OutboxStatus.DEAD}",
                alert=outbox.dead.value > 0,
            ),
            Figure(
                _("held behind failed events"),
                str(outbox.held),
                f"status__exact={OutboxStatus.HELD}",
            ),
            Figure(
                _("configuration errors"),
                str(outbox.configuration_errors),
                f"{pending_query}&failure_kind__exact={FailureKind.CONFIGURATION}",
                alert=outbox.configuration_errors.value > 0,
            ),
        ),
    )


#: The sections of the health panel, in order. Each takes "now" and returns a :class:`Section`.
SECTIONS: list[Callable[[datetime], Section]] = [records_section, outbox_section]


def snapshot(now: datetime | None = None) -> list[Section]:
    """The panel's sections at ``now``: the database's time, by which every lease is judged."""
    now = now or database_now(router.db_for_read(IdempotencyRecord))
    return [section(now) for section in SECTIONS]
