"""The payments endpoint and the lightest create endpoint in every variant, plus a bare GET and
a bare POST.

The bare GET (no database, no DRF) is the ceiling for a replay: the fastest answer this server
gives to anything. The bare POST answers a note replay's request (same headers, same body) with a
note's answer and does nothing else: what that request costs before any idempotency work.
"""

from __future__ import annotations

from typing import TypeVar

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from rest_framework import generics, mixins, viewsets

from benchmarks.benchproject.notes.models import Note
from benchmarks.benchproject.notes.serializers import NoteSerializer
from demo_project.payments import services
from demo_project.payments.models import Payment
from demo_project.payments.serializers import PaymentSerializer

# The demo publishes payment.completed through the outbox, which needs our app and its
# IDEMPOTENCY["OUTBOX_PUBLISHERS"]; drf-idempotency reads a setting of the same name and refuses
# keys it does not know. So no variant publishes the event: the business work stays identical on
# every row, and the rows compare the idempotency layers alone.
services.publish = lambda *args, **kwargs: None


class PlainPaymentViewSet(mixins.CreateModelMixin, viewsets.GenericViewSet[Payment]):
    """The demo's payment POST without any idempotency."""

    queryset = Payment.objects.all()
    serializer_class = PaymentSerializer


class PlainNoteView(generics.CreateAPIView[Note]):
    """The lightest DRF create: a three-field model, JSON in and out, one INSERT."""

    queryset = Note.objects.all()
    serializer_class = NoteSerializer


View = TypeVar("View", bound=type)


def guarded(view: View) -> View:
    """``view`` as this variant guards it (middleware variants, ours-middleware included, guard
    it from outside)."""
    if settings.VARIANT in ("ours", "ours-redis", "ours-memory"):
        from django_idempotency.drf import IdempotencyMixin

        return type(f"Ours{view.__name__}", (IdempotencyMixin, view), {})  # type: ignore[return-value]
    if settings.VARIANT == "drfik":
        from drf_idempotencykey.mixins import DrfIdempotencyKeyMixin

        return type(f"Drfik{view.__name__}", (DrfIdempotencyKeyMixin, view), {})  # type: ignore[return-value]
    return view


def bare_get(request: HttpRequest) -> HttpResponse:
    """A small JSON answer without the database or DRF: the replay ceiling."""
    return HttpResponse(b'{"ok":true}', content_type="application/json")


def bare_post(request: HttpRequest) -> HttpResponse:
    """A note's answer to a note replay's request, without reading it, the database or DRF."""
    return HttpResponse(
        b'{"id":1,"title":"bench","body":"a note","done":false}',
        status=201,
        content_type="application/json",
    )
