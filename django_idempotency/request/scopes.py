"""Scope resolvers: turn a request into the namespace its keys live in."""

from __future__ import annotations

from typing import Any

from django_idempotency.conf import conf


def user_scope(request: Any) -> str:
    """The authenticated user, else the one anonymous scope (``ANONYMOUS_SCOPE``)."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return conf.ANONYMOUS_SCOPE
