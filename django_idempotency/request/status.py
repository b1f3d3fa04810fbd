"""Status and result by key: what a client that lost its answer may ask about its own key.

``include("django_idempotency.urls")`` mounts two read-only views:

* ``GET idempotency-keys/<key>``: ``{"key", "status", "response_status", "created", "expires"}``
  and, once the key completed, a ``Link`` to the stored response;
* ``GET idempotency-keys/<key>/response``: the stored response itself, byte for byte as a retry
  would get it, marked as a replay (``409`` with ``Retry-After`` while the key is processing).

The key is looked up in the caller's scopes only, resolved exactly as for the writes
(``SCOPE_RESOLVER``; with DRF, both after DRF's authentication, as the mixin scoped its writes,
and before it, as the middleware scoped them; see ``drf/views.py``). Everything that is not the
caller's live key is the same ``404``: unknown, expired, released, malformed, or
another scope's, so an answer never tells that a key exists elsewhere. These plain Django views
are the ones mounted when DRF is not installed; the answers are built here for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from functools import partial
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.utils.encoding import escape_uri_path
from django.views import View

from django_idempotency.core.statemachine import COMPLETED
from django_idempotency.exceptions import (
    CredentialsNotScoped,
    IdempotencyHTTPError,
    IdempotencyKeyInvalid,
    IdempotencyKeyNotFound,
    StoreUnavailable,
    TransactionInProgress,
)
from django_idempotency.request import store
from django_idempotency.request.keys import parse_key
from django_idempotency.request.responses import problem_response, replay
from django_idempotency.request.scopes import resolve_scope

__all__ = [
    "RESPONSE_LINK_RELATION",
    "KeyResponseView",
    "KeyStatusView",
    "key_response",
    "key_status",
    "lookup",
]

#: The ``rel`` of the ``Link`` from a completed key's status to its stored response.
RESPONSE_LINK_RELATION = "response"
#: The last path segment of the stored response's URL, under the status URL.
RESPONSE_SEGMENT = "response"


#: The scopes a caller's keys may live in, each asked only when the one before holds no such key.
Scopes = Iterable[Callable[[], str]]


def lookup(scopes: Scopes, raw_key: str) -> store.KeyState:
    """The caller's live key, or :class:`IdempotencyKeyNotFound` whatever else it is.

    ``raw_key`` is the key as stored (the characters between the quotes of a quoted key), taken
    from the URL; ``scopes`` are the caller's (one per door that may have scoped its writes
    differently), asked in order and only for a key that could exist; a scope that cannot be
    told (unscoped credentials) holds nothing.
    """
    try:
        # The URL carries the key itself; quoted and escaped, it goes through the header's own
        # parser, so exactly the keys a request could have claimed are looked up.
        key = parse_key('"' + raw_key.replace("\\", "\\\\").replace('"', '\\"') + '"')
    except IdempotencyKeyInvalid:
        raise IdempotencyKeyNotFound() from None
    asked: set[str] = set()
    for scope in scopes:
        try:
            owner = scope()
        except CredentialsNotScoped:
            continue
        if owner in asked:
            continue
        asked.add(owner)
        try:
            state = store.read(owner, key)
        except store.UNAVAILABLE_ERRORS as exc:
            raise StoreUnavailable() from exc
        if state is not None:
            return state
    raise IdempotencyKeyNotFound()


def key_status(request: HttpRequest, scopes: Scopes, raw_key: str) -> HttpResponse:
    """The status answer (or our problem+json error) for ``GET idempotency-keys/<key>``."""
    try:
        state = lookup(scopes, raw_key)
    except IdempotencyHTTPError as error:
        return _private(problem_response(error))
    completed = state.status == COMPLETED
    body = {
        "key": state.key,
        "status": "completed" if completed else "processing",
        "response_status": state.response.status if state.response is not None else None,
        "created": _timestamp(state.created_at),
        "expires": _timestamp(state.expires_at),
    }
    response = JsonResponse(body)
    if completed:
        # The request's own path, escaped as Django escapes it, so the link works under any
        # prefix the URLconf was included at, for any key.
        target = f"{escape_uri_path(request.path)}/{RESPONSE_SEGMENT}"
        response["Link"] = f'<{target}>; rel="{RESPONSE_LINK_RELATION}"'
    return _private(response)


def key_response(scopes: Scopes, raw_key: str) -> HttpResponse:
    """The stored response, as a retry gets it, for ``GET idempotency-keys/<key>/response``."""
    try:
        state = lookup(scopes, raw_key)
        if state.response is None:
            raise TransactionInProgress(wait=state.retry_after)
    except IdempotencyHTTPError as error:
        return _private(problem_response(error))
    return _private(replay(state.response))


def _timestamp(value: datetime) -> str:
    return value.astimezone(UTC).isoformat()


def _private(response: HttpResponse) -> HttpResponse:
    """One client's answer about its own key: never kept by a cache on the way."""
    response["Cache-Control"] = "no-store"
    return response


class _KeyView(View):
    http_method_names = ["get", "head", "options"]

    def get_idempotency_scope(self, request: HttpRequest) -> str:
        """The caller's scope, as the middleware and ``@idempotent`` resolve it."""
        return resolve_scope(request)


class KeyStatusView(_KeyView):
    """``GET idempotency-keys/<key>`` without DRF: the scope from Django's ``request.user``."""

    def get(self, request: HttpRequest, key: str, **kwargs: Any) -> HttpResponseBase:
        return key_status(request, [partial(self.get_idempotency_scope, request)], key)


class KeyResponseView(_KeyView):
    """``GET idempotency-keys/<key>/response`` without DRF."""

    def get(self, request: HttpRequest, key: str, **kwargs: Any) -> HttpResponseBase:
        return key_response([partial(self.get_idempotency_scope, request)], key)
