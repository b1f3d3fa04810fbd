"""Outbox events: what waits to be published, what failed, and the actions that retry or
discard failed events. The failure groups pages of this admin are in
:mod:`django_idempotency.admin.failure_groups`."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_idempotency import operations
from django_idempotency.admin.base import (
    RecentValuesFilter,
    preformatted,
    pretty_json,
    to_the_second,
)
from django_idempotency.admin.failure_groups import FailureGroupFilter, FailureGroupPages
from django_idempotency.core.failures import FailureKind, normalise
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.models import OutboxEvent
from django_idempotency.operations import health

__all__ = ["FailedFilter", "OutboxEventAdmin", "TopicFilter"]


class TopicFilter(RecentValuesFilter):
    title = _("topic")
    parameter_name = "topic"
    field_name = "topic"

    def samples(self, queryset: QuerySet[Any]) -> list[QuerySet[Any]]:
        # The topics of unpublished events (what an operator looks for), then the latest ones.
        unpublished = queryset.unpublished()  # type: ignore[attr-defined]
        return [unpublished.order_by(), *super().samples(queryset)]


class FailedFilter(admin.SimpleListFilter):
    title = _("failed")
    parameter_name = "failed"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("Failed (dead, or pending a retry)"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return queryset.failed()  # type: ignore[attr-defined, no-any-return]
        return None


class OutboxEventAdmin(FailureGroupPages):
    # As for the records: few columns that wrap. The event id is shortened (its page and the
    # search have it in full), the state carries the failed attempts.
    list_display = (
        "event_display",
        "topic",
        "key_display",
        "state",
        "age",
        "next_attempt",
        "error_display",
    )
    list_display_links = ("event_display",)
    list_filter = ("status", FailedFilter, "failure_kind", TopicFilter, FailureGroupFilter)
    sortable_by = ("age",)
    search_fields = ("event_id", "key")
    search_help_text = _("An exact event id or ordering key.")
    ordering = ("-pk",)
    actions = ("retry_events", "discard_events")
    change_list_template = "admin/django_idempotency/outbox_change_list.html"
    fieldsets = (
        (
            None,
            {"fields": ("event_id", "topic", "key", "status", "attempts", "last_error_display")},
        ),
        (
            _("Failure"),
            {
                "fields": (
                    "failure_kind",
                    "failure_group_display",
                    "failing_since",
                    "last_failed_at",
                    "traceback_display",
                )
            },
        ),
        (_("Message"), {"fields": ("payload_display", "headers_display", "traceparent")}),
        (
            _("Relay"),
            {"fields": ("next_attempt", "next_attempt_time", "lease_until", "relay_token")},
        ),
        # transaction_id is an internal ordering column (0 on most databases): not shown.
        (_("Dates"), {"fields": ("created_at", "published_at", "age")}),
    )
    readonly_fields = (
        *("event_id", "topic", "key", "status", "attempts", "last_error_display"),
        *("payload_display", "headers_display", "traceparent", "next_attempt"),
        *("next_attempt_time", "lease_until", "relay_token", "created_at", "published_at"),
        *("age", "failure_group_display", "failing_since", "last_failed_at", "traceback_display"),
        "failure_kind",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # Payloads can be large; the list never shows them, the detail page loads them.
        return super().get_queryset(request).defer("payload", "headers", "failure_traceback")

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is not None and not (obj.last_error or obj.failure_fingerprint):
            failure = _("Failure")
            return [(name, options) for name, options in fieldsets if name != failure]
        return fieldsets

    # --- columns and fields ---

    @admin.display(description=_("event id"), ordering="pk")
    def event_display(self, event: OutboxEvent) -> SafeString:
        text = str(event.event_id)
        return format_html('<span title="{}">{}…</span>', text, text[:8])

    @admin.display(description=_("key"))
    def key_display(self, event: OutboxEvent) -> str:
        return Truncator(event.key).chars(40) or "–"

    @admin.display(description=_("state"))
    def state(self, event: OutboxEvent) -> SafeString | str:
        label = event.get_status_display()
        if event.status == OutboxStatus.DEAD:
            label = format_html('<strong class="idempotency-alert">{}</strong>', label)
        if not event.attempts:
            return label
        failed = ngettext(
            "%(count)d failed attempt", "%(count)d failed attempts", event.attempts
        ) % {"count": event.attempts}
        return format_html("{} · {}", label, failed)

    @admin.display(description=_("age"), ordering="pk")  # pk order is creation order, indexed
    def age(self, event: OutboxEvent) -> str:
        return health.elapsed(event.created_at, timezone.now())

    @admin.display(description=_("next attempt at"))
    def next_attempt_time(self, event: OutboxEvent) -> str:
        return to_the_second(event.next_attempt_at)

    @admin.display(description=_("relay lease until"))
    def lease_until(self, event: OutboxEvent) -> str:
        return to_the_second(event.locked_until)

    @admin.display(description=_("next attempt"))
    def next_attempt(self, event: OutboxEvent) -> str:
        if event.status == OutboxStatus.PUBLISHED:
            return _("published %(age)s ago") % {
                "age": health.elapsed(event.published_at, timezone.now())
            }
        if event.status == OutboxStatus.DEAD:
            return gettext("none: waits for a person")
        now = timezone.now()
        if event.locked_until is not None and event.locked_until > now:
            return gettext("being published now")
        if event.next_attempt_at > now:
            return _("in %(wait)s") % {"wait": health.elapsed(now, event.next_attempt_at)}
        return gettext("due now")

    @admin.display(description=_("last error"))
    def error_display(self, event: OutboxEvent) -> SafeString | str:
        error = Truncator(event.last_error).chars(60) or "–"
        if event.failure_kind == FailureKind.CONFIGURATION:
            # Retried only every OUTBOX_BACKOFF_MAX_SECONDS: a person must fix the route.
            return format_html(
                '<strong class="idempotency-alert">{}</strong> · {}',
                gettext("configuration error"),
                error,
            )
        return error

    @admin.display(description=_("last error"))
    def last_error_display(self, event: OutboxEvent) -> SafeString | str:
        return preformatted(event.last_error) if event.last_error else "–"

    @admin.display(description=_("payload"))
    def payload_display(self, event: OutboxEvent) -> SafeString:
        return pretty_json(event.payload)

    @admin.display(description=_("headers"))
    def headers_display(self, event: OutboxEvent) -> SafeString:
        return pretty_json(event.headers)

    @admin.display(description=_("failure group"))
    def failure_group_display(self, event: OutboxEvent) -> SafeString | str:
        if not event.failure_fingerprint:
            return "–"
        return format_html(
            '<a href="{}">{}</a>',
            self.changelist_url(failure=event.failure_fingerprint),
            normalise(event.last_error) or event.failure_fingerprint,
        )

    @admin.display(description=_("traceback"))
    def traceback_display(self, event: OutboxEvent) -> SafeString | str:
        return preformatted(event.failure_traceback) if event.failure_traceback else "–"

    # --- actions ---

    @admin.action(description=_("Retry selected failed events now"), permissions=["change"])
    def retry_events(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        result = operations.retry_events(queryset)
        done = ngettext(
            "Queued %(count)d failed event to be sent again.",
            "Queued %(count)d failed events to be sent again.",
            result.changed,
        )
        self.report_events(request, result, done % {"count": result.changed})

    @admin.action(description=_("Discard selected failed events…"), permissions=["delete"])
    def discard_events(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        if request.POST.get("post") == "yes":
            result = operations.discard_events(queryset)
            done = ngettext(
                "Discarded %(count)d failed event.",
                "Discarded %(count)d failed events.",
                result.changed,
            )
            self.report_events(request, result, done % {"count": result.changed})
            return None
        failed = queryset.failed()  # type: ignore[attr-defined]
        failed_count = health.count_rows(failed)
        return self.confirm_action(
            request,
            action="discard_events",
            title=gettext("Discard outbox events"),
            question=gettext(
                "The failed events below will be deleted and never sent; the events queued "
                "behind them on their keys will go next. Events that have not failed, and "
                "events a relay is publishing right now, are left alone. Discard them?"
            ),
            objects=[
                format_html(
                    "{} {} ({}) — {}",
                    self.change_link(event, str(event.event_id)),
                    event.topic,
                    event.status,
                    Truncator(event.last_error).chars(120) or "–",
                )
                for event in failed.order_by("pk")[:20]
            ],
            summary=ngettext(
                "%(count)s selected event has failed.",
                "%(count)s selected events have failed; the first 20 are listed.",
                failed_count.value,
            )
            % {"count": failed_count},
            confirm_label=gettext("Yes, discard them"),
        )

    def report_events(
        self, request: HttpRequest, result: operations.EventResult, done: str
    ) -> None:
        self.message_user(request, done, messages.SUCCESS if result.changed else messages.WARNING)
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
        if result.not_failed:
            self.message_user(
                request,
                ngettext(
                    "Left %(count)d event alone: it has not failed (published, or waiting "
                    "for its first attempt).",
                    "Left %(count)d events alone: they have not failed (published, or "
                    "waiting for their first attempt).",
                    result.not_failed,
                )
                % {"count": result.not_failed},
                messages.INFO,
            )
