"""The failure groups pages: failed outbox events, and the consumers' failed messages, grouped by
what went wrong, with the buttons that requeue or discard a whole group of events.

The pages belong to the outbox events' admin (their URLs are under its own); the queries behind
them are :mod:`django_idempotency.operations.failure_groups`, the changes they make
:mod:`django_idempotency.operations.actions`. The filters here are the ones the pages link to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any, get_args
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_idempotency import operations
from django_idempotency.admin.base import OperationsAdmin, RecentValuesFilter, logger
from django_idempotency.core.failures import FINGERPRINT_LENGTH, normalise
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.models import FailedMessage, OutboxEvent
from django_idempotency.operations import failure_groups, health
from django_idempotency.operations.failure_groups import FailureGroup, GroupState

__all__ = [
    "FailureGroupFilter",
    "FailureGroupPages",
    "GROUPS_PER_PAGE",
    "GROUP_EVENTS_SHOWN",
    "MessageFailureGroupFilter",
    "UNGROUPED",
]

#: Failure groups per page of the failure groups page, the most recently seen first.
GROUPS_PER_PAGE = 50
#: Events listed on a failure group's confirmation page.
GROUP_EVENTS_SHOWN = 20
#: The failure-group filter's value for failed events without a fingerprint: recorded by an
#: earlier version's relay while this one was being rolled out.
UNGROUPED = "none"
_FINGERPRINT = re.compile(rf"[0-9a-f]{{{FINGERPRINT_LENGTH}}}")
_GROUP_STATES = get_args(GroupState)


class FailureGroupFilter(admin.SimpleListFilter):
    """The events of one failure group, reached from the failure groups page. In the sidebar
    only while chosen: offering every group there would group the table on each page load."""

    title = _("failure group")
    parameter_name = "failure"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        value = self.value()
        if not value:
            return []
        if value == UNGROUPED:
            return [(value, _("Failed, not grouped"))]
        newest = failure_groups.newest_failure(OutboxEvent.objects.all(), str(value))
        label = normalise(newest["last_error"]) if newest else str(value)
        return [(str(value), Truncator(label).chars(80))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if not value:
            return None
        if value == UNGROUPED:
            return queryset.failed().filter(failure_fingerprint__isnull=True)  # type: ignore[attr-defined, no-any-return]
        return queryset.filter(failure_fingerprint=value)


class MessageFailureGroupFilter(admin.SimpleListFilter):
    """The failed messages of one failure group, reached from the failure groups page; in the
    sidebar only while chosen."""

    title = _("failure group")
    parameter_name = "failure"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        value = self.value()
        if not value:
            return []
        newest = failure_groups.newest_failure(FailedMessage.objects.all(), str(value))
        label = normalise(newest["last_error"]) if newest else str(value)
        return [(str(value), Truncator(label).chars(80))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        return queryset.filter(failure_fingerprint=value) if value else None


class FailureGroupPages(OperationsAdmin):
    """The failure groups pages, for the outbox events' admin to inherit: their URLs, the
    link to them from the changelist, and the URLs they link to."""

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("failures/", view(self.failure_groups_view), name=f"{prefix}_failures"),
            path(
                "failures/<str:fingerprint>/<str:action>/",
                view(self.failure_group_action_view),
                name=f"{prefix}_failure_group",
            ),
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {"failure_groups_url": self.failure_groups_url(), **(extra_context or {})}
        return super().changelist_view(request, context)

    def admin_url(
        self, name: str, *args: Any, query: Mapping[str, str | None] | None = None
    ) -> str:
        opts = self.opts
        url = reverse(
            f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_{name}", args=args
        )
        present = {key: value for key, value in (query or {}).items() if value}
        return f"{url}?{urlencode(present)}" if present else url

    def changelist_url(self, **query: str | None) -> str:
        return self.admin_url("changelist", query=query)

    def failure_groups_url(self, topic: str | None = None, state: str | None = None) -> str:
        return self.admin_url("failures", query={"topic": topic, "state": state})

    @staticmethod
    def group_filters(data: Mapping[str, str]) -> tuple[str | None, Any]:
        """The topic and state (``dead`` or ``retrying``) a failure groups page is filtered by."""
        state = data.get("state")
        return data.get("topic") or None, state if state in _GROUP_STATES else None

    # --- the failure groups page ---

    def failure_groups_view(self, request: HttpRequest) -> TemplateResponse:
        """Failed events grouped by failure fingerprint, each group with its count, first and
        last seen, topics and newest traceback, and the buttons to requeue or discard it."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        topic, state = self.group_filters(request.GET)
        try:
            page = max(int(request.GET.get("p", "1")), 1)
        except ValueError:
            page = 1
        shown, more = failure_groups.event_groups(
            topic, state, offset=(page - 1) * GROUPS_PER_PAGE, limit=GROUPS_PER_PAGE
        )
        now = timezone.now()
        groups = [self.group_row(group, topic, state, now) for group in shown]
        filters = {"topic": topic, "state": state}
        context = {
            **self.failed_message_groups(request, now),
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": gettext("Failure groups"),
            "groups": groups,
            "topics": failure_groups.topics(topic, sample_size=RecentValuesFilter.sample_size),
            "topic": topic or "",
            "state": state or "",
            "states": [("dead", gettext("Dead")), ("retrying", gettext("Retrying"))],
            "filtered": bool(topic or state),
            "previous_url": self.admin_url("failures", query={**filters, "p": str(page - 1)})
            if page > 1
            else None,
            "next_url": self.admin_url("failures", query={**filters, "p": str(page + 1)})
            if more
            else None,
            "has_change_permission": self.has_change_permission(request),
            "has_delete_permission": self.has_delete_permission(request),
            "ungrouped_url": self.changelist_url(failure=UNGROUPED),
            "changelist_url": self.changelist_url(),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_idempotency/failure_groups.html", context)

    def failed_message_groups(self, request: HttpRequest, now: datetime) -> dict[str, Any]:
        """The consumers' section: failed messages by failure group, for those who may see
        them (the section is left out where ``FailedMessage`` has no admin on this site)."""
        if not self.admin_site.is_registered(FailedMessage):
            return {"message_groups": None}
        messages_admin = self.admin_site.get_model_admin(FailedMessage)
        if not messages_admin.has_view_or_change_permission(request):
            return {"message_groups": None}
        changelist = reverse(f"{self.admin_site.name}:django_idempotency_failedmessage_changelist")
        groups = [
            {
                "group": group,
                "first_seen": health.elapsed(group.first_seen, now),
                "last_seen": health.elapsed(group.last_seen, now),
                "messages_url": f"{changelist}?{urlencode({'failure': group.fingerprint})}",
                "newest_url": reverse(
                    f"{self.admin_site.name}:django_idempotency_failedmessage_change",
                    args=[group.newest["pk"]],
                ),
            }
            for group in failure_groups.message_groups(limit=GROUPS_PER_PAGE)
        ]
        return {"message_groups": groups, "failed_messages_url": changelist}

    def group_row(
        self, group: FailureGroup, topic: str | None, state: str | None, now: datetime
    ) -> dict[str, Any]:
        """What the template shows of a group: the group, its times in words, its links."""
        status = {"dead": OutboxStatus.DEAD, "retrying": OutboxStatus.PENDING}.get(state or "")
        filters = {"topic": topic, "state": state}
        return {
            "group": group,
            "first_seen": health.elapsed(group.first_seen, now) if group.first_seen else "",
            "last_seen": health.elapsed(group.last_seen, now) if group.last_seen else "",
            "events_url": self.changelist_url(
                failure=group.fingerprint, topic=topic, status__exact=status
            ),
            "newest_url": self.admin_url("change", group.newest["pk"]),
            "requeue_url": self.admin_url(
                "failure_group", group.fingerprint, "requeue", query=filters
            ),
            "discard_url": self.admin_url(
                "failure_group", group.fingerprint, "discard", query=filters
            ),
        }

    # --- requeue or discard a group ---

    def failure_group_action_view(
        self, request: HttpRequest, fingerprint: str, action: str
    ) -> HttpResponse:
        """Requeue or discard a failure group (or the part the topic and state filters leave):
        a page that states the count, then the change on the events that still match."""
        if action not in ("requeue", "discard") or not _FINGERPRINT.fullmatch(fingerprint):
            raise Http404
        allowed = (
            self.has_change_permission(request)
            if action == "requeue"
            else self.has_delete_permission(request)
        )
        if not allowed:
            raise PermissionDenied
        data = request.POST if request.method == "POST" else request.GET
        topic, state = self.group_filters(data)
        groups_url = self.failure_groups_url(topic, state)
        if request.method == "POST":
            seen_at = parse_datetime(request.POST.get("seen_at", ""))
            try:
                shown = int(request.POST.get("shown", ""))
            except ValueError:
                seen_at = None
            if seen_at is None or seen_at.tzinfo is None:
                self.message_user(
                    request,
                    gettext(
                        "The confirmation did not say when the group was shown; nothing was "
                        "changed. Open the group again."
                    ),
                    messages.ERROR,
                )
                return HttpResponseRedirect(groups_url)
            selection = operations.FailureGroupSelection(fingerprint, topic, state, seen_at)
            self.act_on_failure_group(request, action, selection, shown)
            return HttpResponseRedirect(groups_url)

        seen_at = failure_groups.seen_now()
        selection = operations.FailureGroupSelection(fingerprint, topic, state, seen_at)
        counts = failure_groups.count(selection)
        if not counts.events:
            self.message_user(
                request,
                gettext("No failed events are left in this failure group; nothing to do."),
                messages.WARNING,
            )
            return HttpResponseRedirect(groups_url)
        newest = failure_groups.newest_failure(selection.events(), fingerprint) or {}
        listed = failure_groups.newest_first(selection)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": gettext("Requeue a failure group")
            if action == "requeue"
            else gettext("Discard a failure group"),
            "action": action,
            "signature": normalise(newest.get("last_error", "")),
            "traceback": newest.get("failure_traceback") or "",
            "count": counts.events,
            "summary": self.group_summary(action, counts.events, counts.dead, topic),
            "objects": [
                format_html(
                    "{} {} ({}) — {}",
                    self.change_link(event, str(event.event_id)),
                    event.topic,
                    event.status,
                    Truncator(event.last_error).chars(120),
                )
                for event in listed.defer("payload", "headers")[:GROUP_EVENTS_SHOWN]
            ],
            "more": max(counts.events - GROUP_EVENTS_SHOWN, 0),
            "topic": topic or "",
            "state": state or "",
            "seen_at": seen_at.isoformat(),
            "groups_url": groups_url,
            "confirm_label": gettext("Yes, requeue them")
            if action == "requeue"
            else gettext("Yes, discard them"),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/django_idempotency/failure_group_confirmation.html", context
        )

    @staticmethod
    def group_summary(action: str, count: int, dead: int, topic: str | None) -> str:
        if action == "requeue":
            text = ngettext(
                "%(count)d failed event will be sent again now (%(dead)d dead, %(retrying)d "
                "waiting for a retry).",
                "%(count)d failed events will be sent again now (%(dead)d dead, %(retrying)d "
                "waiting for a retry).",
                count,
            )
        else:
            text = ngettext(
                "%(count)d failed event will be deleted and never sent (%(dead)d dead, "
                "%(retrying)d waiting for a retry).",
                "%(count)d failed events will be deleted and never sent (%(dead)d dead, "
                "%(retrying)d waiting for a retry).",
                count,
            )
        text %= {"count": count, "dead": dead, "retrying": count - dead}
        if topic:
            text += " " + gettext("Only the topic %(topic)s.") % {"topic": topic}
        return text

    def act_on_failure_group(
        self,
        request: HttpRequest,
        action: str,
        selection: operations.FailureGroupSelection,
        shown: int,
    ) -> None:
        """Requeue or discard what is still in the group, and say what changed since the page
        that asked was shown."""
        if action == "requeue":
            result = operations.retry_failure_group(selection)
            done = ngettext(
                "Requeued %(count)d event of the failure group.",
                "Requeued %(count)d events of the failure group.",
                result.changed,
            )
        else:
            result = operations.discard_failure_group(selection)
            done = ngettext(
                "Discarded %(count)d event of the failure group.",
                "Discarded %(count)d events of the failure group.",
                result.changed,
            )
        level = messages.SUCCESS if result.changed else messages.WARNING
        self.message_user(request, done % {"count": result.changed}, level)
        # What the page showed and is no longer there: published, retried or discarded by
        # someone else, or failing for another reason now.
        left = max(shown - result.changed - result.in_flight, 0)
        if left:
            self.message_user(
                request,
                ngettext(
                    "The group changed since the page was opened: %(left)d of the %(shown)d "
                    "events shown is no longer in it (published, retried, discarded, or "
                    "failing for another reason) and was left alone.",
                    "The group changed since the page was opened: %(left)d of the %(shown)d "
                    "events shown are no longer in it (published, retried, discarded, or "
                    "failing for another reason) and were left alone.",
                    left,
                )
                % {"left": left, "shown": shown},
                messages.WARNING,
            )
        if result.in_flight:
            self.message_user(
                request,
                ngettext(
                    "Left %(count)d event alone: a relay is publishing it right now.",
                    "Left %(count)d events alone: a relay is publishing them right now.",
                    result.in_flight,
                )
                % {"count": result.in_flight},
                messages.WARNING,
            )
        joined = failure_groups.joined_since_seen(selection)
        if joined:
            self.message_user(
                request,
                ngettext(
                    "%(count)d event joined the group after the page was opened and was left "
                    "alone; open the group again to act on it.",
                    "%(count)d events joined the group after the page was opened and were left "
                    "alone; open the group again to act on them.",
                    joined,
                )
                % {"count": joined},
                messages.INFO,
            )
        logger.info(
            "outbox failure group %s by %s: %d events",
            action,
            request.user.get_username(),
            result.changed,
            extra={
                "outbox_failure_group": selection.fingerprint,
                "outbox_action": action,
                "outbox_topic": selection.topic,
                "outbox_state": selection.state,
                "outbox_count": result.changed,
                "outbox_shown": shown,
                "outbox_left": left,
                "outbox_in_flight": result.in_flight,
                "outbox_joined": joined,
                "admin_user": request.user.get_username(),
            },
        )
