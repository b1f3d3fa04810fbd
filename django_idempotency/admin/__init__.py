"""Django admin for the people on call: stuck keys, dead events and consumers' inboxes.

One module per model or page: :mod:`.records`, :mod:`.outbox`, :mod:`.failure_groups`,
:mod:`.failed_messages`, :mod:`.inbox`, :mod:`.overview` (the last 24 hours, drawn by
:mod:`.charts`); what they share is in :mod:`.base`.
``IDEMPOTENCY["REGISTER_ADMIN"] = False`` skips the registration on ``admin.site`` (read once,
when the admin autodiscovers this package); call :func:`register` for a site of your own.
"""

from __future__ import annotations

from django.contrib import admin

from django_idempotency.admin.base import (
    DISPLAY_BODY_CHARS,
    MAX_INDENT_DEPTH,
    ConsumerFilter,
    EstimatingPaginator,
    OperationsAdmin,
    RecentValuesFilter,
    nesting_depth,
    preformatted,
    pretty_body,
    pretty_json,
)
from django_idempotency.admin.failed_messages import FailedMessageAdmin
from django_idempotency.admin.failure_groups import GROUPS_PER_PAGE, FailureGroupFilter
from django_idempotency.admin.health import HealthPanel
from django_idempotency.admin.inbox import ProcessedMessageAdmin
from django_idempotency.admin.outbox import FailedFilter, OutboxEventAdmin, TopicFilter
from django_idempotency.admin.overview import INDEX_TEMPLATE, OverviewPage
from django_idempotency.admin.records import (
    ExpiredFilter,
    IdempotencyRecordAdmin,
    StuckFilter,
)
from django_idempotency.conf import conf
from django_idempotency.models import (
    FailedMessage,
    IdempotencyRecord,
    OutboxEvent,
    ProcessedMessage,
)
from django_idempotency.operations.failure_groups import FailedMessageGroup, FailureGroup

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
    "OverviewPage",
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


def register(site: admin.AdminSite = admin.site) -> None:
    """Register this app's admins on ``site`` (done for ``admin.site`` unless switched off).

    A site without an index template of its own gets one that links to the overview page
    (``admin/django_idempotency/index.html``, Django's index with the link on top).
    """
    site.register(IdempotencyRecord, IdempotencyRecordAdmin)
    site.register(OutboxEvent, OutboxEventAdmin)
    site.register(ProcessedMessage, ProcessedMessageAdmin)
    site.register(FailedMessage, FailedMessageAdmin)
    if site.index_template is None:
        site.index_template = INDEX_TEMPLATE


if conf.REGISTER_ADMIN:
    register()
