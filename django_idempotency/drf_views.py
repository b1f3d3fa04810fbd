"""Status and result by key as DRF views: mounted by ``django_idempotency.urls`` when DRF is
installed, so a token or session client is scoped after DRF's authentication, exactly as
:class:`~django_idempotency.drf.IdempotencyMixin` scoped its writes.

They use the project's ``DEFAULT_AUTHENTICATION_CLASSES`` and throttles, and let everyone in
(``AllowAny``): an unauthenticated caller simply has the anonymous scope (or, when it sent
credentials that no authentication class accepted, the digest of those credentials, as the
middleware would have scoped it), so its lookups of other clients' keys are ``404``. The answers
are the plain views' (``views.py``); only the scope differs in where the user comes from.
"""

from __future__ import annotations

from contextlib import suppress
from functools import partial
from typing import Any

from django.http import HttpResponseBase
from rest_framework.exceptions import AuthenticationFailed, NotAuthenticated
from rest_framework.permissions import AllowAny, BasePermission
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency.request.scopes import resolve_scope
from django_idempotency.views import key_response, key_status

__all__ = ["KeyResponseView", "KeyStatusView"]


class _KeyAPIView(APIView):
    permission_classes: list[type[BasePermission]] = [AllowAny]
    http_method_names = ["get", "head", "options"]

    def perform_authentication(self, request: Request) -> None:
        """Credentials that fail to authenticate leave the caller anonymous: its scope is then
        what the middleware gives such a request, and the lookup a ``404`` like any other."""
        with suppress(AuthenticationFailed, NotAuthenticated):
            request.user  # noqa: B018

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        # The answers are JSON, problem+json or the stored bytes whatever the Accept header
        # asks for: a lookup is never refused with 406.
        return super().perform_content_negotiation(request, force=True)

    def get_idempotency_scope(self, request: Request) -> str:
        """The caller's scope, as ``IdempotencyMixin.get_idempotency_scope`` resolves it."""
        return resolve_scope(request)


class KeyStatusView(_KeyAPIView):
    """``GET idempotency-keys/<key>``: the caller's key, processing or completed."""

    def get(self, request: Request, key: str, **kwargs: Any) -> HttpResponseBase:
        return key_status(request._request, partial(self.get_idempotency_scope, request), key)


class KeyResponseView(_KeyAPIView):
    """``GET idempotency-keys/<key>/response``: the stored response, as a retry would get it."""

    def get(self, request: Request, key: str, **kwargs: Any) -> HttpResponseBase:
        return key_response(partial(self.get_idempotency_scope, request), key)
