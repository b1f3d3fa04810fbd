"""What every admin of this app shares: the read-only base, the paginator that never counts a
whole table, safe display of stored bodies and JSON, and the filters that sample their choices.

Rows are read-only: nothing a form could edit would leave the state machine consistent. State
changes go through actions that call :mod:`django_idempotency.operations.actions` and report
counts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import Field, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import capfirst
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin.health import HealthPanel
from django_idempotency.operations import health

__all__ = [
    "ConsumerFilter",
    "DISPLAY_BODY_CHARS",
    "EstimatingPaginator",
    "MAX_INDENT_DEPTH",
    "OperationsAdmin",
    "RecentValuesFilter",
    "nesting_depth",
    "preformatted",
    "pretty_body",
    "pretty_json",
    "to_the_second",
]

if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Any]
    QuerySetPaginator = Paginator[Any]
else:  # generic only in the type stubs
    ModelAdmin = admin.ModelAdmin
    QuerySetPaginator = Paginator

#: The admin's one logger, whichever module logs: operators filter on its name (see
#: docs/operations-admin.md), which is the name the admin had as a single module.
logger = logging.getLogger("django_idempotency.admin")

#: Bodies longer than this are cut in the detail page (the full body stays in the database).
DISPLAY_BODY_CHARS = 64 * 1024
#: JSON nested deeper than this is not indented: its indentation alone would outgrow the page
#: (and the encoders recurse once or more per level).
MAX_INDENT_DEPTH = 64


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
            "idempotency_health": HealthPanel(self.admin_site, request),
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


def to_the_second(moment: datetime | None) -> str:
    """A moment with its seconds, in the current time zone: leases run for seconds, and the
    admin's own format (``DATETIME_FORMAT``) stops at the minute."""
    if moment is None:
        return "-"
    return date_format(timezone.localtime(moment), "N j, Y, H:i:s T")


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


class ConsumerFilter(RecentValuesFilter):
    title = _("consumer")
    parameter_name = "consumer"
    field_name = "consumer"
