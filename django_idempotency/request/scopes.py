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

from django.utils.crypto import salted_hmac

from django_idempotency.conf import conf
from django_idempotency.core.types import MAX_SCOPE_LENGTH
from django_idempotency.exceptions import CredentialsNotScoped
from django_idempotency.request.keys import header

__all__ = ["MAX_SCOPE_LENGTH", "resolve_scope", "user_scope"]

#: Salt of the credentials digest; the key is derived from SECRET_KEY, so the digest cannot be
#: recomputed (or its credentials guessed) from the database alone.
_CREDENTIALS_SALT = "django_idempotency.scopes.credentials"


def user_scope(request: Any) -> str:
    """The authenticated user; else a digest of the request's credentials; else anonymous."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    credentials = [header(request, name) or "" for name in conf.CREDENTIAL_HEADERS]
    if any(credentials):
        if conf.CREDENTIAL_SCOPE == "refuse":
            raise CredentialsNotScoped()
        digest = salted_hmac(_CREDENTIALS_SALT, "\n".join(credentials), algorithm="sha256")
        return f"credentials:{digest.hexdigest()[:40]}"
    return conf.ANONYMOUS_SCOPE


def resolve_scope(request: Any) -> str:
    """``SCOPE_RESOLVER``'s answer, hashed when it is too long to store."""
    scope = str(conf.SCOPE_RESOLVER(request))
    if len(scope) > MAX_SCOPE_LENGTH:
        # Hashing keeps long tenant identifiers distinct where truncating would merge them.
        scope = "sha256:" + hashlib.sha256(scope.encode()).hexdigest()
    return scope
