"""Long operations behind every door: each view hands a widget's creation to a worker.

The worker (:func:`make_widget`) is a plain ``@handed_off`` function: the tests deliver the
outbox's messages to it themselves (``tests/request/test_handoff.py``), as a Celery worker would,
and the Celery tests (``tests/support/function_celery.py``) run it in a real worker. Under
``tests.support.handoff_urls``, which also mounts the status-by-key views.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency.drf import IdempotencyMixin
from django_idempotency.request.decorators import idempotent
from django_idempotency.request.handoff import ahand_off, hand_off, handed_off
from tests.testapp.models import Widget

#: The topic the views hand off to (the test settings route every topic to MemoryPublisher).
TOPIC = "tests.make_widget"
#: How many times the worker's own code ran, per widget name.
runs: Counter[str] = Counter()


@handed_off
def make_widget(name: str, fail: bool = False, hold_file: str = "") -> HttpResponse:
    """The work: create the widget (raising after it when ``fail``), answer 201."""
    runs[name] += 1
    widget = Widget.objects.create(name=name, created_by="worker")
    deadline = time.monotonic() + 60
    while hold_file and os.path.exists(hold_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    if fail:
        raise RuntimeError("the worker failed after writing")
    return JsonResponse({"id": widget.pk, "name": name}, status=201)


def _work(data: Any) -> dict[str, Any]:
    """The view's part: validate, then name the work. ``{"invalid": true}`` is refused 400."""
    return {
        "name": str(data.get("name", "widget")),
        "fail": bool(data.get("fail", False)),
        "hold_file": str(data.get("hold_file", "")),
    }


def _body(request: HttpRequest) -> dict[str, Any]:
    loaded = json.loads(request.body or b"{}")
    return loaded if isinstance(loaded, dict) else {}


def _invalid() -> HttpResponse:
    return JsonResponse({"error": "invalid"}, status=400)


def middleware_view(request: HttpRequest) -> HttpResponse:
    """Guarded by the middleware (``/doors/middleware/`` is in ``MIDDLEWARE_PATHS``), and below
    by ``@idempotent``."""
    data = _body(request)
    if data.get("invalid"):
        return _invalid()
    return hand_off(request, TOPIC, **_work(data))


decorated_view = idempotent(long_running=True)(middleware_view)


@idempotent(long_running=True)
async def async_view(request: HttpRequest) -> HttpResponse:
    data = _body(request)
    if data.get("invalid"):
        return _invalid()
    await sync_to_async(Widget.objects.create)(name="view-side", created_by="view")
    return await ahand_off(request, TOPIC, **_work(data))


@api_view(["POST"])
@idempotent(long_running=True)
def api_function_view(request: Request) -> HttpResponse:
    if request.data.get("invalid"):
        return _invalid()
    return hand_off(request, TOPIC, **_work(request.data))


class MixinView(IdempotencyMixin, APIView):
    idempotency_long_running = True

    def post(self, request: Request) -> HttpResponse:
        if request.data.get("invalid"):
            return _invalid()
        return hand_off(request, TOPIC, **_work(request.data))


#: Door name -> URL path.
DOORS = {
    "middleware": "/doors/middleware/handoff/",
    "decorator": "/handoff/decorator/",
    "decorator-async": "/handoff/async/",
    "api-function": "/handoff/api-function/",
    "mixin": "/handoff/mixin/",
}

urlpatterns = [
    path("doors/middleware/handoff/", middleware_view),
    path("handoff/decorator/", decorated_view),
    path("handoff/async/", async_view),
    path("handoff/api-function/", api_function_view),
    path("handoff/mixin/", MixinView.as_view()),
    path("keys/", include("django_idempotency.urls")),
]
