"""Idempotency records: the keys requests hold, the responses they stored, and the actions that
release stuck or completed keys.

Every lease here is judged by the database's clock, read with the rows, never by this web
server's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin.base import preformatted, pretty_body, to_the_second
from django_idempotency.admin.overview import OverviewPage
from django_idempotency.core import leases, statuses
from django_idempotency.db import database_now
from django_idempotency.db.querysets import ACCEPTED, PROCESSING
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations import health
from django_idempotency.operations.actions import ReleaseResult, release_records

__all__ = ["ExpiredFilter", "IdempotencyRecordAdmin", "StuckFilter"]


class StuckFilter(admin.SimpleListFilter):
    title = _("stuck")
    parameter_name = "stuck"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("Stuck (lease expired)")), ("no", _("Not stuck"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return queryset.stuck()  # type: ignore[attr-defined, no-any-return]
        if self.value() == "no":
            return queryset.exclude(leases.run_out_q())
        return None


class ExpiredFilter(admin.SimpleListFilter):
    title = _("expired by TTL")
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("Expired, awaiting sweep")), ("no", _("Live"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return queryset.expired()  # type: ignore[attr-defined, no-any-return]
        if self.value() == "no":
            return queryset.live()  # type: ignore[attr-defined, no-any-return]
        return None


class IdempotencyRecordAdmin(OverviewPage):
    # Few columns, each one wrapping, so that the list fits a laptop's screen beside the
    # navigation and the filters: the state says completed (with the status replayed),
    # processing or stuck; the request is the method and the path.
    list_display = ("key_display", "scope_display", "state", "request_display", "age", "lease_left")
    list_filter = (
        "status",
        StuckFilter,
        ExpiredFilter,
        ("created_at", admin.DateFieldListFilter),
    )
    # Sorting any other column sorts millions of rows; these have an index or are cheap enough.
    sortable_by = ("scope_display", "age", "lease_left")
    search_fields = ("key", "scope")
    search_help_text = _("An exact key or scope (keys are case-sensitive).")
    ordering = ("-pk",)
    actions = ("release_keys", "force_release_keys")
    fieldsets = (
        (None, {"fields": ("scope", "key", "status", "stuck", "attempts")}),
        (_("Request"), {"fields": ("method", "path", "fingerprint")}),
        (_("Lease"), {"fields": ("owner_token", "lease_expires", "lease_left")}),
        (
            _("Stored response"),
            {"fields": ("response_status", "headers_display", "body_display")},
        ),
        (_("Dates"), {"fields": ("created_at", "completed_at", "expires_at", "age")}),
    )
    readonly_fields = (
        *("scope", "key", "status", "stuck", "attempts", "method", "path", "fingerprint"),
        *("owner_token", "lease_expires", "lease_left", "response_status", "headers_display"),
        *("body_display", "created_at", "completed_at", "expires_at", "age"),
    )

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is not None and obj.status == PROCESSING:
            # Nothing is stored until the request completes: one line says so.
            stored = _("Stored response")
            return [
                (name, {"fields": ("body_display",)}) if name == stored else (name, options)
                for name, options in fieldsets
            ]
        return fieldsets

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> Any:
        context["release_buttons"] = self.release_buttons(request, obj) if obj else []
        return super().render_change_form(request, context, add, change, form_url, obj)

    def release_buttons(self, request: HttpRequest, record: IdempotencyRecord) -> list[Any]:
        """The list actions that release this one record, as buttons for its page: the same
        actions, permissions and messages as from the list."""
        actions = self.get_actions(request)
        running = leases.running(record.status, record.lease_expires_at, self.judged_at(record))
        if running and "force_release_keys" in actions:
            return [
                {
                    "action": "force_release_keys",
                    "label": gettext("Force release…"),
                    "help": gettext(
                        "A request may still be working on this key: its lease runs. Forcing "
                        "makes that request roll its changes back and answer 409; the "
                        "client's retry then runs once. You are asked first."
                    ),
                }
            ]
        if not running and "release_keys" in actions:
            return [
                {
                    "action": "release_keys",
                    "label": gettext("Release this key"),
                    "help": gettext(
                        "The next request with this key runs as new: at once for a stuck key; "
                        "for a completed one, the request runs again instead of replaying."
                    ),
                }
            ]
        return []

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # The body can be a megabyte per row; the list never shows it, the detail page loads it.
        # Each row carries the database's time: leases are judged by the clock that wrote them,
        # never by this web server's.
        records: QuerySet[Any] = super().get_queryset(request).defer("response_body")
        judged: QuerySet[Any] = records.annotate(judged_at=Now())
        return judged

    @staticmethod
    def judged_at(record: IdempotencyRecord) -> datetime:
        """The database's time when ``record`` was read (read now, for one read elsewhere)."""
        judged: datetime | None = getattr(record, "judged_at", None)
        return judged if judged is not None else database_now(record._state.db or "default")

    # --- columns and fields ---

    @admin.display(description=_("key"))
    def key_display(self, record: IdempotencyRecord) -> str:
        return Truncator(record.key).chars(40)

    @admin.display(description=_("scope"), ordering="scope")
    def scope_display(self, record: IdempotencyRecord) -> SafeString:
        """The scope, which may wrap after each ``:`` (``credentials:`` and its digest) but
        never inside a word: ``anonymous`` or ``user:17`` stay whole however narrow the list."""
        parts = record.scope.split(":")
        return format_html_join(mark_safe(":<wbr>"), "{}", ((part,) for part in parts))

    @admin.display(description=_("request"))
    def request_display(self, record: IdempotencyRecord) -> str:
        return f"{record.method} {Truncator(record.path).chars(60)}"

    @admin.display(description=_("state"))
    def state(self, record: IdempotencyRecord) -> SafeString | str:
        if self.is_stuck(record):
            return format_html('<strong class="idempotency-alert">{}</strong>', _("Stuck"))
        if record.status == PROCESSING:
            return gettext("Processing")
        if record.status == ACCEPTED:
            return gettext("Accepted · with a worker")
        return f"{gettext('Completed')} · {record.response_status}"

    @admin.display(description=_("age"), ordering="created_at")
    def age(self, record: IdempotencyRecord) -> str:
        return health.elapsed(record.created_at, self.judged_at(record))

    @admin.display(description=_("lease expires at"), ordering="lease_expires_at")
    def lease_expires(self, record: IdempotencyRecord) -> str:
        return to_the_second(record.lease_expires_at)

    @admin.display(description=_("lease left"), ordering="lease_expires_at")
    def lease_left(self, record: IdempotencyRecord) -> str:
        if record.status not in statuses.HELD or record.lease_expires_at is None:
            return "–"
        now = self.judged_at(record)
        if record.lease_expires_at > now:
            return health.elapsed(now, record.lease_expires_at)
        return _("expired %(age)s ago") % {"age": health.elapsed(record.lease_expires_at, now)}

    @classmethod
    def is_stuck(cls, record: IdempotencyRecord) -> bool:
        """Held, its lease run out (``core/leases.py``), by the database's clock."""
        return record.status in statuses.HELD and not leases.running(
            record.status, record.lease_expires_at, cls.judged_at(record)
        )

    @admin.display(description=_("stuck"))
    def stuck(self, record: IdempotencyRecord) -> SafeString | str:
        """In words, never a tick: a stuck key needs attention, which a green icon hides."""
        if not self.is_stuck(record):
            return gettext("No")
        return format_html(
            '<strong class="idempotency-alert">{}</strong> {}',
            _("Yes: the lease expired %(age)s ago.")
            % {"age": health.elapsed(record.lease_expires_at, self.judged_at(record))},
            _(
                "The request that held it died or overran; the client's next retry takes the "
                "key over, or release it below."
            ),
        )

    @admin.display(description=_("response headers"))
    def headers_display(self, record: IdempotencyRecord) -> SafeString:
        return preformatted(
            "\n".join(f"{name}: {value}" for name, value in record.response_headers)
        )

    @admin.display(description=_("response body"))
    def body_display(self, record: IdempotencyRecord) -> SafeString:
        if record.status == PROCESSING:
            return format_html(
                "<em>{}</em>",
                _("Nothing stored: the request holding the key has not completed."),
            )
        if not record.response_retained:
            return format_html(
                "<em>{}</em>", _("Not retained: streamed, or larger than MAX_RESPONSE_BYTES.")
            )
        content_type = next(
            (
                str(value)
                for name, value in record.response_headers or ()
                if name.lower() == "content-type"
            ),
            "",
        )
        return pretty_body(record.response_body, content_type)

    # --- actions ---

    @admin.action(
        description=_("Release selected keys (stuck or completed)"), permissions=["delete"]
    )
    def release_keys(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self.report_release(request, release_records(queryset))

    @admin.action(
        description=_("Force release selected keys, even with a running lease…"),
        permissions=["delete"],
    )
    def force_release_keys(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        if request.POST.get("post") == "yes":
            self.report_release(request, release_records(queryset, force=True))
            return None
        running = queryset.lease_active()  # type: ignore[attr-defined]
        running_count = health.count_rows(running)
        shown = list(running.order_by("lease_expires_at")[:20])
        return self.confirm_action(
            request,
            action="force_release_keys",
            title=gettext("Force release idempotency keys"),
            question=gettext(
                "Requests may still be working on the keys below: their lease is running. "
                "Releasing them makes each of those requests roll its changes back and answer "
                "409 when it finishes; the client's retry then runs once. Stuck and completed "
                "keys in the selection are released too. Release them?"
            ),
            objects=[
                format_html(
                    "{} ({}) — {}",
                    self.change_link(record, Truncator(record.key).chars(60)),
                    record.scope,
                    _("lease left: %(left)s") % {"left": self.lease_left(record)},
                )
                for record in shown
            ],
            summary=ngettext(
                "%(count)s selected key has a running lease.",
                "%(count)s selected keys have a running lease; the first 20 are listed.",
                running_count.value,
            )
            % {"count": running_count},
            confirm_label=gettext("Yes, release them"),
        )

    def report_release(self, request: HttpRequest, result: ReleaseResult) -> None:
        self.message_user(
            request,
            ngettext(
                "Released %(count)d idempotency key.",
                "Released %(count)d idempotency keys.",
                result.released,
            )
            % {"count": result.released},
            messages.SUCCESS,
        )
        if result.refused:
            self.message_user(
                request,
                ngettext(
                    "Refused %(count)d key whose lease is still running: a request may be "
                    "working on it. Use “Force release” to release it anyway.",
                    "Refused %(count)d keys whose lease is still running: requests may be "
                    "working on them. Use “Force release” to release them anyway.",
                    result.refused,
                )
                % {"count": result.refused},
                messages.WARNING,
            )
