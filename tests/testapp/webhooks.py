"""Webhook endpoints for ``tests/inbox/test_webhooks.py``: each handler's effect is a widget
named ``<provider>:<event id>``, so counting widgets counts handler runs.

``behaviour[<event id>]`` tells a handler what to do with that event: ``"write"`` (the default),
``"raise"``, ``"503"``, ``"rollback"`` (each after writing its widget), or ``"hold"`` (write,
then say so on ``inside`` and wait for ``release``).
"""

from __future__ import annotations

import threading

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from django_idempotency.inbox.webhooks import (
    CustomProvider,
    GitHub,
    StandardWebhooks,
    Stripe,
    WebhookEvent,
    idempotent_webhook,
)
from tests.testapp.models import Widget

STRIPE_SECRET = "whsec_test_stripe_5f0a4c0e"
GITHUB_SECRET = "It's a Secret to Everybody"
#: base64 of b"standard webhooks test key, 32b!"
STANDARD_SECRET = "whsec_c3RhbmRhcmQgd2ViaG9va3MgdGVzdCBrZXksIDMyYiE="
CUSTOM_TOKEN = "let-me-in"

behaviour: dict[str, str] = {}
inside = threading.Event()
release = threading.Event()


def _act(event: WebhookEvent) -> HttpResponse | None:
    Widget.objects.create(name=f"{event.provider}:{event.id}", created_by=event.type or "")
    mode = behaviour.get(event.id, "write")
    if mode == "raise":
        raise RuntimeError(f"the handler failed on {event.id}")
    if mode == "503":
        return HttpResponse("try later", status=503)
    if mode == "rollback":
        transaction.set_rollback(True)
        return HttpResponse(status=200)
    if mode == "hold":
        inside.set()
        release.wait(30)
    return JsonResponse({"handled": event.id})


@idempotent_webhook(Stripe(secret=STRIPE_SECRET), consumer="stripe-payments")
def stripe_webhook(request: HttpRequest, event: WebhookEvent) -> HttpResponse | None:
    return _act(event)


@idempotent_webhook(GitHub(secret=lambda: GITHUB_SECRET))
def github_webhook(request: HttpRequest, event: WebhookEvent) -> HttpResponse | None:
    return _act(event)


@idempotent_webhook(StandardWebhooks(secret=STANDARD_SECRET), max_body=4096)
def standard_webhook(request: HttpRequest, event: WebhookEvent) -> HttpResponse | None:
    return _act(event)


@idempotent_webhook(StandardWebhooks(secret=STANDARD_SECRET), consumer="standard-async")
async def async_standard_webhook(request: HttpRequest, event: WebhookEvent) -> HttpResponse:
    await Widget.objects.acreate(name=f"async:{event.id}")
    if behaviour.get(event.id) == "raise":
        raise RuntimeError(f"the async handler failed on {event.id}")
    return JsonResponse({"handled": event.id})


def _custom_verify(request: HttpRequest, body: bytes) -> bool:
    return request.headers.get("X-Token") == CUSTOM_TOKEN


def _custom_id(request: HttpRequest, body: bytes) -> str:
    return request.headers["X-Event"]


@idempotent_webhook(
    CustomProvider(verify=_custom_verify, event_id=_custom_id, name="partner"),
    consumer="partner",
)
def custom_webhook(request: HttpRequest, event: WebhookEvent, tenant: str) -> HttpResponse:
    Widget.objects.create(name=f"{event.provider}:{event.id}", created_by=tenant)
    return HttpResponse(status=204)


urlpatterns = [
    path("hooks/stripe/", stripe_webhook),
    path("hooks/github/", github_webhook),
    path("hooks/standard/", standard_webhook),
    path("hooks/standard-async/", async_standard_webhook),
    path("hooks/partner/<str:tenant>/", custom_webhook),
]
