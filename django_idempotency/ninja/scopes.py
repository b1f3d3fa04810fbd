"""The scope of a Ninja operation's keys: who Ninja's authentication says the caller is.

Ninja puts what an operation's auth callback returned on ``request.auth``: a user (Django's
session auth, most bearer schemes), a model instance (an API client), a token string, or
nothing (an operation without auth). A user goes through ``SCOPE_RESOLVER`` as the request's
user, so a project's own resolver (a tenant, say) sees it; the rest are scoped by what they are,
never by a credential itself.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Model
from django.http import HttpRequest
from django.utils.crypto import salted_hmac

from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.request.scopes import resolve_scope

__all__ = ["ninja_scope"]

#: Salt of the digest of a token Ninja's auth returned; keyed by SECRET_KEY, so the database
#: alone never tells the token.
_TOKEN_SALT = "django_idempotency.ninja.scopes.token"


class _AuthenticatedAs:
    """The request, with Ninja's authenticated user as its ``user``, for ``SCOPE_RESOLVER``."""

    def __init__(self, request: HttpRequest, user: Any) -> None:
        self._request = request
        self.user = user

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _is_user(value: object) -> bool:
    return getattr(value, "is_authenticated", False) is True and hasattr(value, "pk")


def ninja_scope(request: HttpRequest) -> str:
    """The scope of ``request.auth``: a user through ``SCOPE_RESOLVER`` (``user:<pk>`` by
    default); another model instance as ``ninja:<app_label.model>:<pk>``; a token (a string,
    bytes, an int or a UUID) as a keyed digest of it; no auth, the request as ``SCOPE_RESOLVER``
    sees it (its session user, its credentials' digest, or the anonymous scope).

    Anything else (``True``, a dict) does not tell callers apart: pass ``scope=`` to
    ``@idempotent``.
    """
    auth = getattr(request, "auth", None)
    if auth is None:
        return resolve_scope(request)
    if _is_user(auth):
        return resolve_scope(_AuthenticatedAs(request, auth))
    if isinstance(auth, Model) and auth.pk is not None:
        return f"ninja:{auth._meta.label_lower}:{auth.pk}"
    if isinstance(auth, str | bytes | int | uuid.UUID) and not isinstance(auth, bool) and auth:
        text = auth.decode("latin-1") if isinstance(auth, bytes) else str(auth)
        digest = salted_hmac(_TOKEN_SALT, text, algorithm="sha256").hexdigest()[:40]
        return f"ninja-token:{digest}"
    raise IdempotencyConfigurationError(
        f"django_idempotency.ninja cannot tell callers apart by request.auth = "
        f"{type(auth).__name__}: its auth returns neither a user, a model instance nor a token. "
        "Pass scope=<a function of the request> to @idempotent, or return the caller's user "
        "or token from the auth's authenticate()."
    )
