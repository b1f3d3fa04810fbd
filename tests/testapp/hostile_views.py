"""Careful views for the hostile-input and security tests (tests/reliability).

Each answers what it cannot read with a 4xx of its own, as a careful application would, so a
500 seen by a test can only come from the idempotency layer around it. Each writes one
``Widget`` per execution (the effect the tests count) and echoes who ran it and what it read.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.core.exceptions import SuspiciousOperation
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from rest_framework.decorators import api_view
from rest_framework.exceptions import APIException
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.drf import IdempotencyMixin
from django_idempotency.request.decorators import idempotent
from tests.testapp.models import Widget

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
#: What reading a hostile body may raise in Django; the views answer these with a 400.
UNREADABLE = (
    MultiPartParserError,
    SuspiciousOperation,
    LookupError,
    UnicodeError,
    ValueError,
    RecursionError,
)
#: Methods the decorated plain view guards besides POST and PATCH.
ODD_METHODS = ("PUT", "DELETE", "PROPFIND", "TRACE", "MKCOL", "X-CUSTOM")


def tenant_of(request: Any) -> str:
    """Who is asking, read independently of the idempotency layer's own scope resolver."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return str(request.META.get("HTTP_X_TENANT", "anonymous"))


def describe_plain(request: HttpRequest) -> tuple[int, dict[str, Any]]:
    """Read the body as a careful plain Django view would; (status, what was read)."""
    try:
        if request.content_type in FORM_TYPES:
            fields = sorted(request.POST)
            files = {name: upload.size for name, upload in request.FILES.items()}
            return 201, {"kind": "form", "fields": len(fields), "files": files}
        digest = hashlib.sha256()
        size = 0
        while chunk := request.read(65536):
            digest.update(chunk)
            size += len(chunk)
    except UNREADABLE as exc:
        return 400, {"kind": "unreadable", "error": type(exc).__name__}
    return 201, {"kind": "raw", "bytes": size, "sha256": digest.hexdigest()}


def _effect(request: Any, read: dict[str, Any], status: int) -> dict[str, Any]:
    tenant = tenant_of(request)
    if status >= 300:
        return {"tenant": tenant, **read}
    widget = Widget.objects.create(name=f"hostile:{read.get('kind')}", created_by=tenant[:200])
    return {"id": widget.pk, "tenant": tenant, **read}


def _plain(request: HttpRequest) -> HttpResponse:
    status, read = describe_plain(request)
    return JsonResponse(_effect(request, read, status), status=status)


def hostile_middleware_view(request: HttpRequest) -> HttpResponse:
    """Guarded by IdempotencyMiddleware (its path matches ``^/plain/middleware/``)."""
    return _plain(request)


@idempotent(methods=("post", "PATCH", *ODD_METHODS))
def hostile_decorated_view(request: HttpRequest) -> HttpResponse:
    """The decorator, guarding odd methods too (given in mixed case on purpose)."""
    return _plain(request)


def _drf_read(request: Any) -> tuple[int, dict[str, Any]]:
    try:
        data = request.data
    except APIException as exc:  # ParseError, UnsupportedMediaType: DRF's own 4xx
        return int(exc.status_code), {"kind": "rejected", "error": type(exc).__name__}
    except UNREADABLE as exc:  # DRF's JSON parser lets RecursionError through as a 500
        return 400, {"kind": "unreadable", "error": type(exc).__name__}
    keys = sorted(data) if hasattr(data, "keys") else []
    return 201, {"kind": type(data).__name__, "fields": len(keys)}


class HostileAPIView(IdempotencyMixin, APIView):
    """The DRF mixin on POST, PATCH and PUT (PUT is not guarded: it passes straight through)."""

    def post(self, request: Any) -> Response:
        status, read = _drf_read(request)
        return Response(_effect(request, read, status), status=status)

    def patch(self, request: Any) -> Response:
        return self.post(request)

    def put(self, request: Any) -> Response:
        return self.post(request)


@api_view(["POST", "PATCH"])
@idempotent
def hostile_api_function_view(request: Any) -> Response:
    """The decorator below ``@api_view``."""
    status, read = _drf_read(request)
    return Response(_effect(request, read, status), status=status)


# --- security ----------------------------------------------------------------------------------

#: Every header the library must never store or replay, set by :func:`leaky_view`.
LEAKY_HEADERS = {
    "Authorization": "Bearer tenant-secret",
    "Proxy-Authorization": "Basic c2VjcmV0OnNlY3JldA==",
    "Cookie": "sessionid=tenant-secret",
    "Set-Cookie": "sessionid=tenant-secret; HttpOnly",
    "WWW-Authenticate": 'Bearer realm="secret"',
    "Proxy-Authenticate": 'Basic realm="secret"',
}


@idempotent
def leaky_view(request: HttpRequest) -> HttpResponse:
    """Answers with credentials in its headers, and a body ``size`` bytes long if asked."""
    data = json.loads(request.body or b"{}")
    widget = Widget.objects.create(name="leaky", created_by=tenant_of(request)[:200])
    body = {"id": widget.pk, "tenant": tenant_of(request)}
    padding = int(data.get("size", 0)) - len(json.dumps(body, separators=(",", ":"))) - 13
    if padding > 0:
        body["padding"] = "x" * padding  # 13 bytes: ',"padding":""'
    response = HttpResponse(
        json.dumps(body, separators=(",", ":")),
        status=int(data.get("status", 201)),
        content_type="application/json",
    )
    for name, value in LEAKY_HEADERS.items():
        response[name] = value
    response.set_cookie("session-ish", "tenant-secret")
    response["Location"] = f"/widgets/{widget.pk}"
    return response
