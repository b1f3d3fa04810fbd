"""The consumers' inbox: which messages each consumer has processed, read-only."""

from __future__ import annotations

from django.contrib import admin
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin.base import ConsumerFilter, OperationsAdmin
from django_idempotency.models import ProcessedMessage
from django_idempotency.operations import health

__all__ = ["ProcessedMessageAdmin"]


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
