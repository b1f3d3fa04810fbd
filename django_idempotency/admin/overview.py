"""The overview page: the health panel, then the last 24 hours hour by hour, as charts drawn on
the server (:mod:`.charts`) from :mod:`django_idempotency.operations.overview`.

The page belongs to the idempotency records' admin (its URL is under theirs, and seeing it takes
their view permission); the outbox's and the failures' charts show for those who may see
outbox events and failed messages. The admin index links to it (``register()`` gives the site
an index template with the link unless it has its own), and so does the health panel.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.formats import number_format
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext

from django_idempotency.admin.base import OperationsAdmin, to_the_second
from django_idempotency.admin.charts import Chart, Series
from django_idempotency.admin.health import HealthPanel
from django_idempotency.db.querysets import ACCEPTED, COMPLETED, PROCESSING, OutboxStatus
from django_idempotency.models import FailedMessage, IdempotencyRecord, OutboxEvent
from django_idempotency.operations import health, overview

__all__ = ["INDEX_TEMPLATE", "OverviewPage", "overview_url", "sections"]

#: The admin index with a link to the overview, given to a site that has no index template.
INDEX_TEMPLATE = "admin/django_idempotency/index.html"


def overview_url(site: admin.AdminSite) -> str | None:
    if not site.is_registered(IdempotencyRecord):
        return None
    return reverse(f"{site.name}:django_idempotency_idempotencyrecord_overview")


class OverviewPage(OperationsAdmin):
    """The overview's URL and view, for the records' admin to inherit."""

    def get_urls(self) -> list[URLPattern]:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path(
                "overview/",
                self.admin_site.admin_view(self.overview_view),
                name=f"{prefix}_overview",
            ),
            *super().get_urls(),
        ]

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        started = time.perf_counter()
        window = overview.window()
        panel = HealthPanel(self.admin_site, request)
        panel.sections  # noqa: B018 - computed now, so that the time below covers it
        shown = sections(self.admin_site, request, window)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": gettext("Overview: the last 24 hours"),
            "idempotency_health": panel,
            "sections": shown,
            "now": to_the_second(window.now),
            "elapsed_ms": (time.perf_counter() - started) * 1000,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_idempotency/overview.html", context)


def _may_view(site: admin.AdminSite, request: HttpRequest, model: type[Model]) -> bool:
    if not site.is_registered(model):
        return False
    return bool(site.get_model_admin(model).has_view_or_change_permission(request))


def _changelist(site: admin.AdminSite, model: type[Model], **query: str) -> str:
    opts = model._meta
    url = reverse(f"{site.name}:{opts.app_label}_{opts.model_name}_changelist")
    return f"{url}?{urlencode(query)}" if query else url


def sections(
    site: admin.AdminSite, request: HttpRequest, window: overview.Window
) -> list[dict[str, Any]]:
    """The page's sections, each a title and its charts (with the figures under each)."""
    found = [{"title": gettext("Idempotency keys"), "charts": _record_charts(site, window)}]
    if _may_view(site, request, OutboxEvent):
        flow, dead = _outbox_charts(site, window)
        messages = _may_view(site, request, FailedMessage)
        failures = [dead, _failure_chart(site, window, messages=messages)]
        found.append({"title": gettext("Outbox"), "charts": flow})
        found.append({"title": gettext("Failures"), "charts": failures})
    return found


def _record_charts(site: admin.AdminSite, window: overview.Window) -> list[dict[str, Any]]:
    hours = overview.record_hours(window)
    counts = hours.outcomes

    def records(**query: str) -> str:
        return _changelist(site, IdempotencyRecord, **query)

    refused = tuple(a + b for a, b in zip(counts["refused"], counts["conflict"], strict=True))
    outcomes = Chart(
        key="outcomes",
        title=gettext("Requests by outcome"),
        description=gettext(
            "Idempotency keys claimed each hour, by what became of them: the response stored "
            "(2xx and 3xx; 4xx), handed to a worker, still running, or stuck (its lease ran "
            "out). A request that failed released its key and is not counted."
        ),
        hours=window.hours,
        series=(
            Series(
                gettext("succeeded"),
                counts["succeeded"],
                "ok",
                records(status__exact=COMPLETED),
            ),
            Series(gettext("refused (4xx)"), refused, "refused", records(status__exact=COMPLETED)),
            Series(
                gettext("handed to a worker"),
                counts["accepted"],
                "accepted",
                records(status__exact=ACCEPTED),
            ),
            Series(
                gettext("in flight"),
                counts["in_flight"],
                "flight",
                records(status__exact=PROCESSING, stuck="no"),
            ),
            Series(gettext("stuck"), counts["stuck"], "stuck", records(stuck="yes")),
        ),
        empty_text=gettext("No request claimed a key in the last 24 hours."),
    )
    held = overview.held_now(window.now)
    notes = [
        ngettext(
            "%(count)s key is held right now: a retry of it is answered 409.",
            "%(count)s keys are held right now: a retry of any of them is answered 409.",
            held.value,
        )
        % {"count": held}
    ]
    counted = overview.conflicts_counted()
    if counted is not None:
        where = (
            gettext("by this server process since it started")
            if counted.scope == "process"
            else gettext("by every worker process of this host (PROMETHEUS_MULTIPROC_DIR)")
        )
        notes.append(
            gettext("409s answered to duplicates in flight, counted %(where)s: %(count)s.")
            % {"where": where, "count": number_format(counted.value, force_grouping=True)}
        )
    conflicts = Chart(
        key="conflicts",
        title=gettext("409 Conflict"),
        description=gettext(
            "A duplicate that arrives while its request runs is answered 409 and recorded "
            "nowhere (Prometheus counts it: django_idempotency_claims_total"
            '{outcome="conflicted"}). Each hour here: the requests claimed then whose stored '
            "response is a 409 (the view's own, replayed to every retry), and those whose lease "
            "ran out and whose key a retry took over (retries were answered 409 until then)."
        ),
        hours=window.hours,
        series=(
            Series(gettext("409 stored"), counts["conflict"], "conflict"),
            Series(gettext("taken over"), hours.taken_over, "takeover"),
        ),
        kind="grouped",
        empty_text=gettext("No stored 409 and no key taken over in the last 24 hours."),
    )
    return [{"chart": outcomes, "notes": []}, {"chart": conflicts, "notes": notes}]


def _outbox_charts(
    site: admin.AdminSite, window: overview.Window
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The backlog's and the lag's charts, and the dead events'."""
    hours = overview.outbox_hours(window)
    pending = _changelist(site, OutboxEvent, status__exact=OutboxStatus.PENDING)
    dead_url = _changelist(site, OutboxEvent, status__exact=OutboxStatus.DEAD)
    backlog = Chart(
        key="backlog",
        title=gettext("Outbox backlog"),
        description=gettext(
            "Events waiting to be published at the end of each hour (the last point: now): "
            "those pending now, and those published or gone dead since."
        ),
        hours=window.hours,
        series=(
            Series(gettext("pending"), hours.backlog, "backlog", pending),
            Series(gettext("published in the hour"), hours.published, "ok"),
        ),
        kind="lines",
        empty_text=gettext("No event waited and none was published in the last 24 hours."),
    )

    def seconds(values: tuple[Any, ...]) -> tuple[float | None, ...]:
        return tuple(None if value is None else value.total_seconds() for value in values)

    lag_series = [Series(gettext("slowest"), seconds(hours.lag_max), "max")]
    if hours.percentiles:
        lag_series[:0] = [
            Series(gettext("median"), seconds(hours.lag_p50), "p50"),
            Series(gettext("95th percentile"), seconds(hours.lag_p95), "p95"),
        ]
    lag = Chart(
        key="lag",
        title=gettext("Commit → publish lag"),
        description=gettext(
            "From publish(), in the transaction that commits the event, to the broker "
            "accepting it, over the events published each hour (logarithmic scale)."
        ),
        hours=window.hours,
        series=tuple(lag_series),
        kind="lines",
        seconds=True,
        empty_text=gettext("No event was published in the last 24 hours."),
    )
    lag_notes = (
        []
        if hours.percentiles
        else [gettext("The median and the 95th percentile are computed on PostgreSQL only.")]
    )
    dead_now = health.outbox_health().dead
    dead = Chart(
        key="dead",
        title=gettext("Dead events"),
        description=gettext(
            "Events that went dead each hour (after OUTBOX_MAX_ATTEMPTS failures) and wait for "
            "a person: retry or discard them."
        ),
        hours=window.hours,
        series=(Series(gettext("went dead"), hours.dead, "stuck", dead_url),),
        empty_text=gettext("No event went dead in the last 24 hours."),
    )
    dead_notes = [
        ngettext("%(count)s event is dead now.", "%(count)s events are dead now.", dead_now.value)
        % {"count": dead_now}
    ]
    flow = [{"chart": backlog, "notes": []}, {"chart": lag, "notes": lag_notes}]
    return flow, {"chart": dead, "notes": dead_notes}


#: The colours of the failure groups drawn one by one, then of the others.
GROUP_TONES = ("g1", "g2", "g3", "g4", "g5")


def _failure_chart(
    site: admin.AdminSite, window: overview.Window, *, messages: bool
) -> dict[str, Any]:
    hours = overview.failure_hours(window, messages=messages)
    series = []
    for group, tone in zip(hours.groups, GROUP_TONES, strict=False):
        model = OutboxEvent if group.kind == "event" else FailedMessage
        prefix = gettext("event") if group.kind == "event" else gettext("message")
        label = f"{prefix}: {Truncator(group.signature).chars(70)}"
        url = _changelist(site, model, failure=group.fingerprint)
        series.append(Series(label, group.failures, tone, url))
    if any(hours.other):
        series.append(Series(gettext("other groups"), hours.other, "other"))
    chart = Chart(
        key="failures",
        title=gettext("Failure groups"),
        description=gettext(
            "Failing outbox events and failed messages by the hour of their latest failure, "
            "per failure group: the groups with the most failures one by one."
        ),
        hours=window.hours,
        series=tuple(series),
        empty_text=gettext("Nothing failed in the last 24 hours."),
    )
    failures_url = reverse(f"{site.name}:django_idempotency_outboxevent_failures")
    notes = [
        ngettext(
            "%(count)d failure group failed in the last 24 hours.",
            "%(count)d failure groups failed in the last 24 hours.",
            hours.groups_seen,
        )
        % {"count": hours.groups_seen}
    ]
    return {"chart": chart, "notes": notes, "link": failures_url}
