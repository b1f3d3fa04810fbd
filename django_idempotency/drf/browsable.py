"""The browsable API, able to send guarded requests: :class:`IdempotentBrowsableAPIRenderer`.

DRF's browsable API has no way to send a request header, so a view guarded by
:class:`~django_idempotency.drf.IdempotencyMixin` answers its forms ``400
idempotency_key_missing``. This renderer adds an ``Idempotency-Key`` field to its page, filled
with a fresh key, and a small script (``django_idempotency/browsable-api.js``) that sends the
field's value as the header with every guarded request the page's forms make. The key travels in
the header only, never in the body, exactly as a client's would::

    REST_FRAMEWORK = {
        "DEFAULT_RENDERER_CLASSES": [
            "rest_framework.renderers.JSONRenderer",
            "django_idempotency.drf.browsable.IdempotentBrowsableAPIRenderer",
        ],
    }

On views that guard no method the page is DRF's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework.renderers import BrowsableAPIRenderer

from django_idempotency.conf import conf

__all__ = ["IdempotentBrowsableAPIRenderer"]


class IdempotentBrowsableAPIRenderer(BrowsableAPIRenderer):
    """DRF's browsable API, with an Idempotency-Key field on the pages of guarded views."""

    template = "django_idempotency/browsable_api.html"

    def get_context(
        self, data: Any, accepted_media_type: str | None, renderer_context: Mapping[str, Any]
    ) -> dict[str, Any]:
        context: dict[str, Any] = super().get_context(data, accepted_media_type, renderer_context)
        view = renderer_context["view"]
        allowed = {method.upper() for method in getattr(view, "allowed_methods", ())}
        guarded = sorted(
            method
            for method in (m.upper() for m in getattr(view, "idempotent_methods", ()))
            if method in allowed
        )
        context["idempotency"] = (
            {"header": conf.HEADER, "replay_header": conf.REPLAY_HEADER, "methods": guarded}
            if guarded
            else None
        )
        return context
