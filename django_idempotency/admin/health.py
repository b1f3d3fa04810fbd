"""The health panel at the top of every changelist of this app: its figures come from
:mod:`django_idempotency.operations.health`, each linked to the changelist that lists its rows."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse

from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations import health

__all__ = ["HealthPanel"]


class HealthPanel:
    """The health sections for the top of a changelist, computed only when rendered."""

    def __init__(self, site: admin.AdminSite, request: HttpRequest | None = None) -> None:
        self.site = site
        #: Who looks: the link to the overview shows only if they may open it.
        self.request = request

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

    @cached_property
    def overview_url(self) -> str | None:
        """The overview page of the last 24 hours (:mod:`.overview`), where the site has it and
        the request's user may see it (the idempotency records)."""
        if not self.site.is_registered(IdempotencyRecord):
            return None
        records = self.site.get_model_admin(IdempotencyRecord)
        if self.request is not None and not records.has_view_or_change_permission(self.request):
            return None
        try:
            return reverse(f"{self.site.name}:django_idempotency_idempotencyrecord_overview")
        except NoReverseMatch:  # pragma: no cover - an admin without the overview's URL
            return None

    def _url(self, model: type[Any], query: str) -> str | None:
        if not query or not self.site.is_registered(model):
            return None
        opts = model._meta
        try:
            changelist = reverse(f"{self.site.name}:{opts.app_label}_{opts.model_name}_changelist")
        except NoReverseMatch:  # pragma: no cover - a site without URLs
            return None
        return f"{changelist}?{query}"
