"""Status and result by key as DRF views: mounted by ``django_idempotency.urls`` when DRF is
installed. A caller's keys are looked up in the scope DRF's authentication gives it, as
:class:`~django_idempotency.drf.IdempotencyMixin` scoped its writes, and then in the scope it had
before (Django's user, or a digest of its credentials), as ``IdempotencyMiddleware``, which runs
before DRF authenticates, scoped them: a token client finds its keys whichever door wrote them.

They use the project's ``DEFAULT_AUTHENTICATION_CLASSES`` and throttles, and let everyone in
(``AllowAny``): an unauthenticated caller simply has the anonymous scope (or, when it sent
credentials that no authentication class accepted, the digest of those credentials, as the
middleware would have scoped it), so its lookups of other clients' keys are ``404``. The answers
are the plain views' (``views.py``); only the scope differs in where the user comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from functools import partial
from typing import Any

from django.http import HttpResponseBase
from rest_framework.exceptions import AuthenticationFailed, NotAuthenticated
from rest_framework.permissions import AllowAny, BasePermission
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency.exceptions import CredentialsNotScoped
from django_idempotency.request.scopes import resolve_scope
from django_idempotency.request.status import key_response, key_status

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

    #: The caller's scope before DRF authenticated it, as the middleware saw it; None when it
    #: cannot be told (credentials with ``CREDENTIAL_SCOPE = "refuse"``).
    middleware_scope: str | None = None

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # Django's request still has Django's own user here; DRF replaces it as it authenticates.
        try:
            self.middleware_scope = resolve_scope(request._request)
        except CredentialsNotScoped:
            self.middleware_scope = None
        super().initial(request, *args, **kwargs)

    def get_idempotency_scope(self, request: Request) -> str:
        """The caller's scope, as ``IdempotencyMixin.get_idempotency_scope`` resolves it."""
        return resolve_scope(request)

    def scopes(self, request: Request) -> list[Callable[[], str]]:
        """Where the caller's keys may be: DRF's scope first, then the middleware's."""
        return [partial(self.get_idempotency_scope, request), self._middleware_scope]

    def _middleware_scope(self) -> str:
        if self.middleware_scope is None:
            raise CredentialsNotScoped()
        return self.middleware_scope


class KeyStatusView(_KeyAPIView):
    """``GET idempotency-keys/<key>``: the caller's key, processing or completed."""

    def get(self, request: Request, key: str, **kwargs: Any) -> HttpResponseBase:
        return key_status(request._request, self.scopes(request), key)


class KeyResponseView(_KeyAPIView):
    """``GET idempotency-keys/<key>/response``: the stored response, as a retry would get it."""

    def get(self, request: Request, key: str, **kwargs: Any) -> HttpResponseBase:
        return key_response(self.scopes(request), key)
