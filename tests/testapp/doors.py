"""One behaviour behind every entry point, so a guarantee is tested on each door alike.

``behave`` does what the JSON body's ``mode`` says; the views below expose it through the
middleware (sync, async, and a DRF view without the mixin), ``@idempotent`` (sync and async),
``@idempotent`` below ``@api_view``, and the DRF mixin. Modes:

``write`` (default)
    create a widget, answer 201.
``raise``
    create a widget, then raise: a 500.
``rollback``
    create a widget, then ``transaction.set_rollback(True)`` and answer 409 "declined".
``integrity``
    create a widget, then hit a unique constraint without a savepoint, catch the IntegrityError
    and answer 409 "duplicate".
``*_once``
    any of the above on the first attempt of a key, ``write`` on later ones (counted per key).
``validate``
    DRF doors: raise a ValidationError (400) after writing; others answer 400 themselves.
``hold_file`` (with any mode)
    after writing, wait while that file exists (at most a minute): a request held in flight
    across processes until the test deletes the file.
``X-Deny: yes`` and ``X-Throttle: N`` (headers, DRF doors)
    a permission that refuses the request (403), and a throttle of N requests per key (429).
``hold`` (with any mode)
    after writing, say so on ``views.started[hold]`` and wait for ``views.gates[hold]`` (the
    ``gate`` fixture): a request held in flight in this process.
``charge`` (with any mode)
    first charge that order through ``@idempotent_function`` (``tests/testapp/charges.py``),
    ``charge_times`` times (1 by default), as a helper might; a 201 carries the charge.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from rest_framework import exceptions
from rest_framework.decorators import api_view, permission_classes, throttle_classes
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from django_idempotency.drf import IdempotencyMixin
from django_idempotency.request.decorators import idempotent
from tests.testapp import charges, views
from tests.testapp.models import Widget

#: How many times each key reached the view (``*_once`` modes, and re-execution checks).
calls: Counter[str] = Counter()


def behave(request: Any, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    key = request.headers.get("Idempotency-Key", "")
    calls[key] += 1
    mode = str(data.get("mode", "write"))
    if mode.endswith("_once"):
        mode = mode.removesuffix("_once") if calls[key] == 1 else "write"
    user = getattr(request, "user", None)
    who = str(user.pk) if user is not None and user.is_authenticated else "anonymous"
    charged = None
    if data.get("charge"):
        for _ in range(int(data.get("charge_times", 1))):
            charged = charges.charge(str(data["charge"]))
    widget = Widget.objects.create(name=str(data.get("name", "door")), created_by=who)
    if data.get("hold") in views.gates:
        views.started[data["hold"]].set()
        views.gates[data["hold"]].wait(30)
    if data.get("hold_file"):
        deadline = time.monotonic() + 60
        while os.path.exists(data["hold_file"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    if mode == "raise":
        raise RuntimeError("the view failed after writing")
    if mode == "rollback":
        transaction.set_rollback(True)
        return 409, {"error": "declined"}
    if mode == "integrity":
        try:
            Widget.objects.create(pk=widget.pk, name="duplicate")
        except IntegrityError:
            return 409, {"error": "duplicate"}
    if mode == "validate":
        if isinstance(request, Request):
            raise exceptions.ValidationError({"name": ["not this one"]})
        return 400, {"name": ["not this one"]}
    body: dict[str, Any] = {"id": widget.pk, "who": who, "calls": calls[key]}
    if charged is not None:
        body["charge"] = charged
    return 201, body


def _data(request: HttpRequest) -> dict[str, Any]:
    loaded = json.loads(request.body or b"{}")
    return loaded if isinstance(loaded, dict) else {}


def _json(status: int, body: dict[str, Any]) -> HttpResponse:
    return JsonResponse(body, status=status)


def plain(request: HttpRequest) -> HttpResponse:
    """Guarded by the middleware (``MIDDLEWARE_PATHS`` covers ``/doors/middleware``)."""
    return _json(*behave(request, _data(request)))


async def plain_async(request: HttpRequest) -> HttpResponse:
    from asgiref.sync import sync_to_async

    return _json(*await sync_to_async(behave)(request, _data(request)))


class DenyWhenAsked(BasePermission):
    """Refuses a request that sends ``X-Deny: yes``: a permission the same body can fail."""

    def has_permission(self, request: Any, view: Any) -> bool:
        return bool(request.headers.get("X-Deny") != "yes")


class PerKeyWhenAsked(SimpleRateThrottle):
    """``X-Throttle: N`` allows N requests per idempotency key an hour; no header, no limit."""

    rate = "1/hour"

    def allow_request(self, request: Any, view: Any) -> bool:
        asked = request.headers.get("X-Throttle")
        if not asked:
            return True
        self.num_requests = int(asked)
        return bool(super().allow_request(request, view))

    def get_cache_key(self, request: Any, view: Any) -> str:
        return f"doors-throttle:{request.headers.get('Idempotency-Key')}"


class PlainAPIView(APIView):
    """A DRF view without the mixin, guarded by the middleware."""

    permission_classes = [DenyWhenAsked]
    throttle_classes = [PerKeyWhenAsked]

    def post(self, request: Request) -> Response:
        status, body = behave(request, request.data)
        return Response(body, status=status)


@idempotent
def decorated(request: HttpRequest) -> HttpResponse:
    return _json(*behave(request, _data(request)))


@idempotent
async def decorated_async(request: HttpRequest) -> HttpResponse:
    from asgiref.sync import sync_to_async

    return _json(*await sync_to_async(behave)(request, _data(request)))


@api_view(["POST"])
@permission_classes([DenyWhenAsked])
@throttle_classes([PerKeyWhenAsked])
@idempotent
def api_function(request: Request) -> Response:
    status, body = behave(request, request.data)
    return Response(body, status=status)


class MixinView(IdempotencyMixin, APIView):
    permission_classes = [DenyWhenAsked]
    throttle_classes = [PerKeyWhenAsked]

    def post(self, request: Request) -> Response:
        status, body = behave(request, request.data)
        return Response(body, status=status)


#: Door name -> URL path; every door answers the same bodies the same way.
DOORS = {
    "middleware": "/doors/middleware/",
    "middleware-async": "/doors/middleware/async/",
    "middleware-drf": "/doors/middleware/drf/",
    "decorator": "/doors/decorator/",
    "decorator-async": "/doors/decorator/async/",
    "api-function": "/doors/api-function/",
    "mixin": "/doors/mixin/",
}

urlpatterns = [
    path("middleware/", plain),
    path("middleware/async/", plain_async),
    path("middleware/drf/", PlainAPIView.as_view()),
    path("decorator/", decorated),
    path("decorator/async/", decorated_async),
    path("api-function/", api_function),
    path("mixin/", MixinView.as_view()),
    path("handoff-charge/", charges.hand_off_charge),
]
