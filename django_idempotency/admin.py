"""Django admin for the people on call: stuck keys, dead events and consumers' inboxes.

Rows are read-only: nothing a form could edit would leave the state machine consistent. State
changes go through actions that call :mod:`django_idempotency.operations.actions` and report counts.
``IDEMPOTENCY["REGISTER_ADMIN"] = False`` skips the registration on ``admin.site`` (read once,
when the admin autodiscovers this module); call :func:`register` for a site of your own.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db import router
from django.db.models import Count, F, Field, Q, QuerySet
from django.db.models.functions import Now
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator, capfirst
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_idempotency import operations
from django_idempotency.conf import conf
from django_idempotency.core import leases, statuses
from django_idempotency.core.failures import FINGERPRINT_LENGTH, FailureKind, normalise
from django_idempotency.db import database_now
from django_idempotency.db.querysets import (
    ACCEPTED,
    PROCESSING,
    FailedMessageQuerySet,
    OutboxEventQuerySet,
    OutboxStatus,
)
from django_idempotency.models import (
    FailedMessage,
    IdempotencyRecord,
    OutboxEvent,
    ProcessedMessage,
)
from django_idempotency.operations import health
from django_idempotency.operations.actions import (
    ReleaseResult,
    forget_failed_messages,
    release_records,
)

__all__ = [
    "ConsumerFilter",
    "DISPLAY_BODY_CHARS",
    "EstimatingPaginator",
    "ExpiredFilter",
    "FailedFilter",
    "FailedMessageAdmin",
    "FailedMessageGroup",
    "FailureGroup",
    "FailureGroupFilter",
    "GROUPS_PER_PAGE",
    "HealthPanel",
    "IdempotencyRecordAdmin",
    "MAX_INDENT_DEPTH",
    "OperationsAdmin",
    "OutboxEventAdmin",
    "ProcessedMessageAdmin",
    "RecentValuesFilter",
    "StuckFilter",
    "TopicFilter",
    "nesting_depth",
    "preformatted",
    "pretty_body",
    "pretty_json",
    "register",
]

if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Any]
    QuerySetPaginator = Paginator[Any]
else:  # generic only in the type stubs
    ModelAdmin = admin.ModelAdmin
    QuerySetPaginator = Paginator

logger = logging.getLogger(__name__)

#: Bodies longer than this are cut in the detail page (the full body stays in the database).
DISPLAY_BODY_CHARS = 64 * 1024
#: JSON nested deeper than this is not indented: its indentation alone would outgrow the page
#: (and the encoders recurse once or more per level).
MAX_INDENT_DEPTH = 64

# --- shared by every admin of this app -----------------------------------------------------------


class EstimatingPaginator(QuerySetPaginator):
    """Exact counts below ``health.COUNT_LIMIT``; above it the PostgreSQL planner's estimate.

    The admin's default paginator runs ``COUNT(*)`` on every page load, which reads millions of
    rows on PostgreSQL. Where no estimate exists (other databases), it counts exactly.
    """

    @cached_property
    def count(self) -> int:
        object_list = self.object_list
        if not isinstance(object_list, QuerySet):
            return len(object_list)
        rows = health.count_rows(object_list)
        return object_list.count() if rows.kind == "at_least" else rows.value


class HealthPanel:
    """The health sections for the top of a changelist, computed only when rendered."""

    def __init__(self, site: admin.AdminSite) -> None:
        self.site = site

    @cached_property
    def sections(self) -> list[dict[str, Any]]:
        return [
            {
                "title": section.title,
                "figures": [
                    {"figure": figure, "url": self._url(section.model, figure.query)}
                    for figure in section.figures
                ],
            }
            for section in health.snapshot()
        ]

    def _url(self, model: type[Any], query: str) -> str | None:
        if not query or not self.site.is_registered(model):
            return None
        opts = model._meta
        try:
            changelist = reverse(f"{self.site.name}:{opts.app_label}_{opts.model_name}_changelist")
        except NoReverseMatch:  # pragma: no cover - a site without URLs
            return None
        return f"{changelist}?{query}"


class OperationsAdmin(ModelAdmin):
    """Read-only rows, actions through ``operations.py``, a health panel, no full COUNT."""

    change_list_template = "admin/django_idempotency/change_list.html"
    change_form_template = "admin/django_idempotency/change_form.html"
    paginator = EstimatingPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facets COUNT every filter choice on each page load
    list_per_page = 50

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Without an object this guards the actions; with one, the edit form, which never shows.
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Deleting goes through actions that also clean up after the row (signals, Redis).
        return obj is None and super().has_delete_permission(request)

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 passes where the actions are shown (list or form); older versions do not.
        where = {} if action_location is None else {"action_location": action_location}
        actions = super().get_actions(request, **where)
        actions.pop("delete_selected", None)
        return actions

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """Exact match on any of ``search_fields``: a substring search would scan every row.

        A term a field cannot hold (not a UUID for a UUID field, say) just does not match it.
        """
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q()
        for name in self.search_fields:
            field = self.opts.get_field(name)
            try:
                value = field.to_python(term) if isinstance(field, Field) else term
            except ValidationError:
                continue
            match |= Q(**{name: value})
        return (queryset.filter(match) if match else queryset.none()), False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {
            "title": capfirst(self.opts.verbose_name_plural),
            "idempotency_health": HealthPanel(self.admin_site),
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)

    def confirm_action(
        self,
        request: HttpRequest,
        *,
        action: str,
        title: str,
        question: str,
        objects: Sequence[Any],
        summary: str,
        confirm_label: str,
    ) -> TemplateResponse:
        """An intermediate page that posts the same selection back with ``post=yes``."""
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "question": question,
            "objects": objects,
            "summary": summary,
            "action": action,
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "confirm_label": confirm_label,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/django_idempotency/action_confirmation.html", context
        )

    def change_link(self, obj: Any, text: str) -> SafeString:
        """A link to ``obj``'s (read-only) detail page, for confirmation pages."""
        opts = self.opts
        url = reverse(
            f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_change",
            args=[quote(obj.pk)],
        )
        return format_html('<a href="{}">{}</a>', url, text)


def preformatted(text: str) -> SafeString:
    if len(text) > DISPLAY_BODY_CHARS:
        cut = _("… (%(size)d characters in all)") % {"size": len(text)}
        text = text[:DISPLAY_BODY_CHARS] + "\n" + cut
    return format_html('<pre class="idempotency-pre">{}</pre>', text)


def nesting_depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value``, counted without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def pretty_json(value: Any) -> SafeString:
    """JSON indented for reading, escaped so nothing in it becomes markup; compact past
    ``MAX_INDENT_DEPTH``. Too deep even for the compact encoder, the page says so rather than
    failing."""
    indent = 2 if nesting_depth(value) <= MAX_INDENT_DEPTH else None
    try:
        return preformatted(json.dumps(value, indent=indent, ensure_ascii=False, sort_keys=True))
    except RecursionError:
        return format_html("<em>{}</em>", _("Nested too deep to show here."))


def pretty_body(body: bytes | memoryview | None, content_type: str) -> SafeString:
    """A stored body shown safely: JSON indented, text escaped, binary summarised."""
    data = bytes(body or b"")
    if not data:
        return format_html("<em>{}</em>", _("(empty)"))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return format_html(
            "<em>{}</em>",
            _("%(size)d bytes of binary data (%(type)s), not shown.")
            % {"size": len(data), "type": content_type or _("no content type")},
        )
    if "json" in content_type.lower() or text.lstrip()[:1] in ("{", "["):
        try:
            value = json.loads(text)
            if nesting_depth(value) <= MAX_INDENT_DEPTH:
                return pretty_json(value)
        except (ValueError, RecursionError):
            pass  # not JSON after all, or too deep to parse: the text as stored
    return preformatted(text)


# --- idempotency records -------------------------------------------------------------------------


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


def to_the_second(moment: datetime | None) -> str:
    """A moment with its seconds, in the current time zone: leases run for seconds, and the
    admin's own format (``DATETIME_FORMAT``) stops at the minute."""
    if moment is None:
        return "-"
    return date_format(timezone.localtime(moment), "N j, Y, H:i:s T")


class IdempotencyRecordAdmin(OperationsAdmin):
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


# --- outbox events -------------------------------------------------------------------------------


class RecentValuesFilter(admin.SimpleListFilter):
    """Choices from a sample of rows rather than a ``DISTINCT`` over the column, which would read
    the whole table on every page load. The chosen value is always offered."""

    field_name: str
    #: Rows read per sample.
    sample_size = 10_000

    def samples(self, queryset: QuerySet[Any]) -> list[QuerySet[Any]]:
        """Where choices come from: by default the latest rows."""
        return [queryset.order_by("-pk")]

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        rows = model_admin.get_queryset(request)
        values: set[str] = set()
        for sample in self.samples(rows):
            values.update(sample.values_list(self.field_name, flat=True)[: self.sample_size])
        if self.value():
            values.add(str(self.value()))
        return [(value, value) for value in sorted(values)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() is None:
            return None
        return queryset.filter(**{self.field_name: self.value()})


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


#: Failure groups per page of the failure groups page, the most recently seen first.
GROUPS_PER_PAGE = 50
#: Events listed on a failure group's confirmation page.
GROUP_EVENTS_SHOWN = 20
#: The failure-group filter's value for failed events without a fingerprint: recorded by an
#: earlier version's relay while this one was being rolled out.
UNGROUPED = "none"
_FINGERPRINT = re.compile(rf"[0-9a-f]{{{FINGERPRINT_LENGTH}}}")
_GROUP_STATES = ("dead", "retrying")


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
        newest = newest_failure(OutboxEvent.objects.all(), str(value))
        label = normalise(newest["last_error"]) if newest else str(value)
        return [(str(value), Truncator(label).chars(80))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if not value:
            return None
        if value == UNGROUPED:
            return queryset.failed().filter(failure_fingerprint__isnull=True)  # type: ignore[attr-defined, no-any-return]
        return queryset.filter(failure_fingerprint=value)


@dataclass(frozen=True, slots=True)
class FailureGroup:
    """A row of the failure groups page: the aggregate, and the group's newest failure."""

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
    """A row of the failure groups page's consumers section."""

    fingerprint: str
    signature: str
    messages: int
    consumers: int
    #: The first consumer by name (the only one when ``consumers`` is 1).
    consumer: str
    first_seen: datetime | None
    last_seen: datetime | None
    newest: Mapping[str, Any]


class OutboxEventAdmin(OperationsAdmin):
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

    # --- failure groups ---

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

    @staticmethod
    def failed_events(topic: str | None, state: str | None) -> OutboxEventQuerySet:
        events = OutboxEvent.objects.failed()
        if topic:
            events = events.filter(topic=topic)
        if state:
            dead = state == "dead"
            events = events.filter(status=OutboxStatus.DEAD if dead else OutboxStatus.PENDING)
        return events

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
        events = self.failed_events(topic, state)
        offset = (page - 1) * GROUPS_PER_PAGE
        rows = list(events.failure_groups()[offset : offset + GROUPS_PER_PAGE + 1])
        now = timezone.now()
        groups = []
        for row in rows[:GROUPS_PER_PAGE]:
            group = self.failure_group(events, row)
            if group is not None:
                groups.append(self.group_row(group, topic, state, now))
        filters = {"topic": topic, "state": state}
        context = {
            **self.failed_message_groups(request, now),
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": gettext("Failure groups"),
            "groups": groups,
            "topics": self.group_topics(topic),
            "topic": topic or "",
            "state": state or "",
            "states": [("dead", gettext("Dead")), ("retrying", gettext("Retrying"))],
            "filtered": bool(topic or state),
            "previous_url": self.admin_url("failures", query={**filters, "p": str(page - 1)})
            if page > 1
            else None,
            "next_url": self.admin_url("failures", query={**filters, "p": str(page + 1)})
            if len(rows) > GROUPS_PER_PAGE
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
        failed = FailedMessage.objects.all()
        groups = []
        for row in failed.failure_groups()[:GROUPS_PER_PAGE]:
            newest = newest_failure(failed, row["failure_fingerprint"])
            if newest is None:
                continue
            group = FailedMessageGroup(
                fingerprint=row["failure_fingerprint"],
                signature=normalise(newest["last_error"]),
                messages=row["messages"],
                consumers=row["consumers"],
                consumer=row["consumer"],
                first_seen=row["first_seen"],
                last_seen=row["last_seen"],
                newest=newest,
            )
            groups.append(
                {
                    "group": group,
                    "first_seen": health.elapsed(group.first_seen, now),
                    "last_seen": health.elapsed(group.last_seen, now),
                    "messages_url": f"{changelist}?{urlencode({'failure': group.fingerprint})}",
                    "newest_url": reverse(
                        f"{self.admin_site.name}:django_idempotency_failedmessage_change",
                        args=[newest["pk"]],
                    ),
                }
            )
        return {"message_groups": groups, "failed_messages_url": changelist}

    @staticmethod
    def failure_group(events: OutboxEventQuerySet, row: Mapping[str, Any]) -> FailureGroup | None:
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

    @staticmethod
    def group_topics(chosen: str | None) -> list[str]:
        """The topics for the filter: those of a sample of grouped failed events (a DISTINCT
        over all of them would read every failed event, of which an outage makes many), and
        the chosen one."""
        grouped = OutboxEvent.objects.failed().filter(failure_fingerprint__isnull=False)
        sample = grouped.order_by().values_list("topic", flat=True)[
            : RecentValuesFilter.sample_size
        ]
        topics = set(sample)
        if chosen:
            topics.add(chosen)
        return sorted(topics)

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

        seen_at = database_now(router.db_for_write(OutboxEvent))
        selection = operations.FailureGroupSelection(fingerprint, topic, state, seen_at)
        events = selection.events()
        counts = events.aggregate(
            events=Count("pk"), dead=Count("pk", filter=Q(status=OutboxStatus.DEAD))
        )
        if not counts["events"]:
            self.message_user(
                request,
                gettext("No failed events are left in this failure group; nothing to do."),
                messages.WARNING,
            )
            return HttpResponseRedirect(groups_url)
        newest = newest_failure(events, fingerprint) or {}
        listed = events.order_by(F("last_failed_at").desc(nulls_last=True), "-pk")
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": gettext("Requeue a failure group")
            if action == "requeue"
            else gettext("Discard a failure group"),
            "action": action,
            "signature": normalise(newest.get("last_error", "")),
            "traceback": newest.get("failure_traceback") or "",
            "count": counts["events"],
            "summary": self.group_summary(action, counts["events"], counts["dead"], topic),
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
            "more": max(counts["events"] - GROUP_EVENTS_SHOWN, 0),
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
        whole = operations.FailureGroupSelection(
            selection.fingerprint, selection.topic, selection.state
        )
        joined = whole.events().filter(failing_since__gt=selection.seen_at).count()
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


# --- processed messages --------------------------------------------------------------------------


class ConsumerFilter(RecentValuesFilter):
    title = _("consumer")
    parameter_name = "consumer"
    field_name = "consumer"


class ProcessedMessageAdmin(OperationsAdmin):
    """The consumers' inbox, read-only: deleting a marker would let a redelivery run again."""

    list_display = ("consumer", "message_id", "processed_at", "age")
    list_filter = (ConsumerFilter, ("processed_at", admin.DateFieldListFilter))
    sortable_by = ("processed_at", "age")
    search_fields = ("message_id", "consumer")
    search_help_text = _("An exact message id or consumer.")
    ordering = ("-pk",)
    fields = ("consumer", "message_id", "processed_at", "age")
    readonly_fields = fields

    @admin.display(description=_("age"), ordering="pk")
    def age(self, message: ProcessedMessage) -> str:
        return health.elapsed(message.processed_at, timezone.now())


class MessageFailureGroupFilter(admin.SimpleListFilter):
    """The failed messages of one failure group, reached from the failure groups page; in the
    sidebar only while chosen."""

    title = _("failure group")
    parameter_name = "failure"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        value = self.value()
        if not value:
            return []
        newest = newest_failure(FailedMessage.objects.all(), str(value))
        label = normalise(newest["last_error"]) if newest else str(value)
        return [(str(value), Truncator(label).chars(80))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        return queryset.filter(failure_fingerprint=value) if value else None


class FailedMessageAdmin(OperationsAdmin):
    """Messages whose handler raised, until it succeeds or an operator forgets them. The broker
    holds the message and redelivers it; forgetting the record does not touch the message."""

    list_display = ("consumer", "message_id", "attempts", "error_display", "last_failed")
    list_filter = (ConsumerFilter, MessageFailureGroupFilter)
    sortable_by = ()
    search_fields = ("message_id", "consumer")
    search_help_text = _("An exact message id or consumer.")
    ordering = ("-pk",)
    actions = ("forget_failures",)
    change_list_template = "admin/django_idempotency/failed_message_change_list.html"
    fields = (
        *("consumer", "message_id", "attempts", "last_error_display", "failure_group_display"),
        *("failing_since", "last_failed_at", "traceback_display"),
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).defer("failure_traceback")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        url: str | None = None
        if self.admin_site.is_registered(OutboxEvent):
            url = reverse(f"{self.admin_site.name}:django_idempotency_outboxevent_failures")
        context = {"failure_groups_url": url and f"{url}#consumers", **(extra_context or {})}
        return super().changelist_view(request, context)

    @admin.display(description=_("last error"))
    def error_display(self, message: FailedMessage) -> str:
        return Truncator(message.last_error).chars(60)

    @admin.display(description=_("last failed"))
    def last_failed(self, message: FailedMessage) -> str:
        return _("%(age)s ago") % {"age": health.elapsed(message.last_failed_at, timezone.now())}

    @admin.display(description=_("last error"))
    def last_error_display(self, message: FailedMessage) -> SafeString:
        return preformatted(message.last_error)

    @admin.display(description=_("failure group"))
    def failure_group_display(self, message: FailedMessage) -> SafeString:
        opts = self.opts
        changelist = reverse(
            f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_changelist"
        )
        query = urlencode({"failure": message.failure_fingerprint})
        return format_html(
            '<a href="{}?{}">{}</a>', changelist, query, normalise(message.last_error)
        )

    @admin.display(description=_("traceback"))
    def traceback_display(self, message: FailedMessage) -> SafeString | str:
        return preformatted(message.failure_traceback) if message.failure_traceback else "–"

    @admin.action(description=_("Forget selected failures…"), permissions=["delete"])
    def forget_failures(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        group = request.GET.get("failure") or None
        if request.POST.get("post") == "yes":
            forgotten = forget_failed_messages(queryset, failure_group=group)
            self.message_user(
                request,
                ngettext(
                    "Forgot %(count)d failed message.",
                    "Forgot %(count)d failed messages.",
                    forgotten,
                )
                % {"count": forgotten},
                messages.SUCCESS if forgotten else messages.WARNING,
            )
            logger.info(
                "inbox failures forgotten by %s: %d",
                request.user.get_username(),
                forgotten,
                extra={
                    "admin_user": request.user.get_username(),
                    "inbox_count": forgotten,
                    "inbox_failure_group": group,
                },
            )
            return None
        count = queryset.count()
        return self.confirm_action(
            request,
            action="forget_failures",
            title=gettext("Forget failed messages"),
            question=gettext(
                "The records of the failed messages below will be deleted: they leave their "
                "failure groups. The messages themselves are the broker's, which redelivers "
                "them or not as it would anyway; a message that fails again is recorded again. "
                "Forget them?"
            ),
            objects=[
                format_html(
                    "{} {} — {}",
                    self.change_link(message, message.message_id),
                    message.consumer,
                    Truncator(message.last_error).chars(120),
                )
                for message in queryset.order_by("-pk")[:GROUP_EVENTS_SHOWN]
            ],
            summary=ngettext(
                "%(count)d failed message is selected.",
                "%(count)d failed messages are selected; the latest 20 are listed.",
                count,
            )
            % {"count": count},
            confirm_label=gettext("Yes, forget them"),
        )


def register(site: admin.AdminSite = admin.site) -> None:
    """Register this app's admins on ``site`` (done for ``admin.site`` unless switched off)."""
    site.register(IdempotencyRecord, IdempotencyRecordAdmin)
    site.register(OutboxEvent, OutboxEventAdmin)
    site.register(ProcessedMessage, ProcessedMessageAdmin)
    site.register(FailedMessage, FailedMessageAdmin)


if conf.REGISTER_ADMIN:
    register()
