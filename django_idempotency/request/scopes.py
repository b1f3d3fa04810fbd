"""Scope resolvers: turn a request into the namespace its keys live in.

A key is only ever replayed inside its scope, so the scope must tell clients apart. The default,
:func:`user_scope`, uses the authenticated user. A request whose user is anonymous but which
carries credentials (``CREDENTIAL_HEADERS``: an ``Authorization`` header for DRF token, JWT or
Basic authentication that only the view will check) is scoped by a keyed digest of those
credentials, never the credentials themselves, or refused (``CREDENTIAL_SCOPE = "refuse"``):
otherwise two API clients sending the same key behind the middleware would share the one
anonymous scope and receive each other's responses.
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.http import HttpRequest

from django_idempotency.conf import conf
from django_idempotency.core.types import MAX_SCOPE_LENGTH
from django_idempotency.exceptions import CredentialsNotScoped
from django_idempotency.request.keys import header, salted_digest

__all__ = ["MAX_SCOPE_LENGTH", "credentials_scope", "resolve_scope", "user_scope"]

#: Salt of the credentials digest; the key is derived from SECRET_KEY, so the digest cannot be
#: recomputed (or its credentials guessed) from the database alone.
_CREDENTIALS_SALT = "django_idempotency.scopes.credentials"


def user_scope(request: Any) -> str:
    """The authenticated user; else a digest of the request's credentials; else anonymous."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    credentials = _credentials(request)
    if credentials is not None:
        if conf.CREDENTIAL_SCOPE == "refuse":
            raise CredentialsNotScoped()
        return _digest_scope(credentials)
    return conf.ANONYMOUS_SCOPE


def credentials_scope(request: HttpRequest) -> str | None:
    """The scope :func:`user_scope` gives an API client before any view has authenticated it:
    the digest of its credentials, from the request alone. None for a request without
    credentials, one whose Django user is authenticated (a session), or with
    ``CREDENTIAL_SCOPE = "refuse"``."""
    user = getattr(request, "user", None)
    if (user is not None and user.is_authenticated) or conf.CREDENTIAL_SCOPE == "refuse":
        return None
    credentials = _credentials(request)
    return None if credentials is None else _digest_scope(credentials)


def _credentials(request: Any) -> list[str] | None:
    credentials = [header(request, name) or "" for name in conf.CREDENTIAL_HEADERS]
    return credentials if any(credentials) else None


def _digest_scope(credentials: list[str]) -> str:
    digest = salted_digest(_CREDENTIALS_SALT, "\n".join(credentials))
    return f"credentials:{digest[:40]}"


def resolve_scope(request: Any) -> str:
    """``SCOPE_RESOLVER``'s answer, hashed when it is too long to store."""
    scope = str(conf.SCOPE_RESOLVER(request))
    if len(scope) > MAX_SCOPE_LENGTH:
        # Hashing keeps long tenant identifiers distinct where truncating would merge them.
        scope = "sha256:" + hashlib.sha256(scope.encode()).hexdigest()
    return scope
