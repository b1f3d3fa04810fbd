"""Views that exercise every integration. The JSON body steers what they do:

``name`` (required), ``sleep`` seconds, ``hold_file`` (wait while that file exists),
``fail`` (raise), ``status`` (answer with it), ``stream`` (streaming response), ``big`` (bytes
of padding in the response).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from rest_framework import serializers, viewsets
from rest_framework.authentication import TokenAuthentication
from rest_framework.decorators import api_view
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.throttling import AnonRateThrottle
from rest_framework.views import APIView

from django_idempotency.drf import IdempotencyMixin
from django_idempotency.outbox import publish
from django_idempotency.request.decorators import idempotent
from tests.testapp.models import Widget

#: Tests set an event here to hold a view until they release it.
gates: dict[str, threading.Event] = {}
#: Views record here that they started, so a test knows a request is inside the view.
started: dict[str, threading.Event] = {}


class BoomError(RuntimeError):
    pass


def perform(data: dict[str, Any], request: Any) -> tuple[Widget, dict[str, Any]]:
    name = str(data.get("name", ""))
    widget = Widget.objects.create(name=name, created_by=str(getattr(request, "user", "")))
    if name in started:
        started[name].set()
    if name in gates:
        gates[name].wait(30)
    if data.get("sleep"):
        time.sleep(float(data["sleep"]))
    if data.get("hold_file"):  # held across processes until the test deletes the file
        deadline = time.monotonic() + 60
        while os.path.exists(data["hold_file"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    if data.get("fail"):
        raise BoomError("the view failed after writing")
    lease = getattr(getattr(request, "_request", request), "idempotency", None)
    body = {
        "id": widget.pk,
        "name": name,
        "attempt": lease.attempt if lease else None,
        "derived_key": lease.derived_key("charge") if lease else None,
        "padding": "x" * int(data.get("big", 0)),
    }
    return widget, body


def plain_response(data: dict[str, Any], widget: Widget, body: dict[str, Any]) -> HttpResponse:
    if data.get("stream"):
        return StreamingHttpResponse(iter([b"streamed ", str(widget.pk).encode()]), status=200)
    response = JsonResponse(body, status=int(data.get("status", 201)))
    response["Location"] = f"/widgets/{widget.pk}"
    response["X-Widget-Id"] = str(widget.pk)
    response["X-Not-Stored"] = "1"
    response.set_cookie("session-ish", "secret")
    return response


def _json(request: HttpRequest) -> dict[str, Any]:
    try:
        data = json.loads(request.body or b"{}")
    except ValueError:
        return {"name": request.POST.get("name", "form")}
    return data if isinstance(data, dict) else {}


class WidgetSerializer(serializers.ModelSerializer[Widget]):
    class Meta:
        model = Widget
        fields = ["id", "name", "created_by"]


class WidgetViewSet(IdempotencyMixin, viewsets.ModelViewSet[Widget]):
    queryset = Widget.objects.all()
    serializer_class = WidgetSerializer

    def perform_create(self, serializer: Any) -> None:
        serializer.save(created_by=str(self.request.user))


class WidgetAPIView(IdempotencyMixin, APIView):
    def post(self, request: Any) -> Any:
        data = request.data if isinstance(request.data, dict) else {}
        widget, body = perform(data, request)
        if data.get("stream"):
            return plain_response(data, widget, body)
        response = Response(body, status=int(data.get("status", 201)))
        response["Location"] = f"/widgets/{widget.pk}"
        response["X-Widget-Id"] = str(widget.pk)
        response["X-Not-Stored"] = "1"
        response.set_cookie("session-ish", "secret")
        return response

    def patch(self, request: Any) -> Any:
        return self.post(request)

    def put(self, request: Any) -> Any:
        return self.post(request)


class AuthenticatedWidgetView(WidgetAPIView):
    permission_classes = [IsAuthenticated]


class ThrottledWidgetView(WidgetAPIView):
    throttle_classes = [AnonRateThrottle]
    throttle_scope = "anon"

    def get_throttles(self) -> list[Any]:
        throttle = AnonRateThrottle()
        throttle.rate = "1/hour"
        throttle.num_requests, throttle.duration = throttle.parse_rate(throttle.rate)
        return [throttle]


class CountingTokenAuthentication(TokenAuthentication):
    """DRF's token authentication, counting the requests it authenticated."""

    calls = 0

    def authenticate(self, request: Any) -> Any:
        CountingTokenAuthentication.calls += 1
        return super().authenticate(request)


class TokenWidgetView(WidgetAPIView):
    """Token clients only, their keys scoped by DRF's user."""

    authentication_classes = [CountingTokenAuthentication]
    permission_classes = [IsAuthenticated]


class CredentialScopedWidgetView(TokenWidgetView):
    """Token clients only, their keys scoped by their credentials: replays before DRF."""

    idempotency_scope_by_credentials = True


class CredentialScopedWidgetViewSet(WidgetViewSet):
    """A viewset whose token clients' keys are scoped by their credentials: each route (list,
    detail) replays before DRF with its own ``Allow``."""

    authentication_classes = [CountingTokenAuthentication]
    permission_classes = [IsAuthenticated]
    idempotency_scope_by_credentials = True


class HeartbeatWidgetView(WidgetAPIView):
    idempotency_heartbeat = True


@api_view(["POST"])
@idempotent
def api_function_view(request: Any) -> Any:
    widget, body = perform(request.data, request)
    return Response(body, status=201, headers={"Location": f"/widgets/{widget.pk}"})


@idempotent
def plain_function_view(request: HttpRequest) -> HttpResponse:
    data = _json(request)
    widget, body = perform(data, request)
    return plain_response(data, widget, body)


def plain_undecorated_view(request: HttpRequest) -> HttpResponse:
    """Guarded by IdempotencyMiddleware through MIDDLEWARE_PATHS."""
    data = _json(request)
    widget, body = perform(data, request)
    return plain_response(data, widget, body)


async def async_view(request: HttpRequest) -> HttpResponse:
    data = json.loads(request.body or b"{}")
    widget = await Widget.objects.acreate(name=str(data.get("name", "")))
    if data.get("fail"):
        raise BoomError("async view failed after writing")
    return JsonResponse({"id": widget.pk, "name": widget.name}, status=201)


def upload_view(request: HttpRequest) -> HttpResponse:
    sizes = {name: upload.size for name, upload in request.FILES.items()}
    Widget.objects.create(name=f"upload:{request.POST.get('name', '')}")
    return JsonResponse({"sizes": sizes, "fields": dict(request.POST.items())}, status=201)


def raw_body_view(request: HttpRequest) -> HttpResponse:
    total = 0
    while chunk := request.read(65536):
        total += len(chunk)
    Widget.objects.create(name=f"raw:{total}")
    return JsonResponse({"bytes": total}, status=201)


@idempotent
def publish_view(request: HttpRequest) -> HttpResponse:
    """An idempotent request that writes a widget and announces it through the outbox, in the
    transaction the decorator opens."""
    widget = Widget.objects.create(name=str(_json(request).get("name", "")))
    payload = {"name": widget.name, "widget_id": widget.pk}
    event = publish("widgets.created", payload, key=widget.pk)
    return JsonResponse({"id": widget.pk, "event_id": str(event.event_id)}, status=201)


def relay_view(request: HttpRequest) -> HttpResponse:
    """Relays everything due from this (gunicorn worker) process: the multiprocess metrics test."""
    from django_idempotency.outbox.relay import Relay

    with Relay() as relay:
        stats = relay.drain()
    return JsonResponse({"pid": os.getpid(), **stats.as_dict()})


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics view docs/metrics.md shows for gunicorn: every worker's counters added up,
    and the outbox gauges read once, from the database."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from django_idempotency.operations.gauges import OutboxCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    registry.register(OutboxCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
