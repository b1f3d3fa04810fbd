"""The consumers' failed messages: whose handler raised, until it succeeds or an operator
forgets the record. Their failure groups are on the failure groups page
(:mod:`django_idempotency.admin.failure_groups`)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin.base import ConsumerFilter, OperationsAdmin, logger, preformatted
from django_idempotency.admin.failure_groups import GROUP_EVENTS_SHOWN, MessageFailureGroupFilter
from django_idempotency.core.failures import normalise
from django_idempotency.models import FailedMessage, OutboxEvent
from django_idempotency.operations import health
from django_idempotency.operations.actions import forget_failed_messages

__all__ = ["FailedMessageAdmin"]


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
