"""A database router for the tests that keep the idempotency records in their own database."""

from __future__ import annotations

from typing import Any


class RecordsElsewhere:
    """Every model of django_idempotency lives in the ``records`` database; the rest stays."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "records" if model._meta.app_label == "django_idempotency" else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self.db_for_read(model)
