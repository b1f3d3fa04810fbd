"""The payments endpoint in every variant, plus a bare GET for the ceiling."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from rest_framework import mixins, viewsets

from demo_project.payments.models import Payment
from demo_project.payments.serializers import PaymentSerializer


class PlainPaymentViewSet(mixins.CreateModelMixin, viewsets.GenericViewSet[Payment]):
    """The demo's payment POST without any idempotency."""

    queryset = Payment.objects.all()
    serializer_class = PaymentSerializer


def guarded_viewset() -> type[PlainPaymentViewSet]:
    """What guards the endpoint in this variant (middleware variants guard it from outside)."""
    if settings.VARIANT in ("ours", "ours-redis"):
        from django_idempotency.drf import IdempotencyMixin

        return type("OursPaymentViewSet", (IdempotencyMixin, PlainPaymentViewSet), {})
    if settings.VARIANT == "drfik":
        from drf_idempotencykey.mixins import DrfIdempotencyKeyMixin

        return type("DrfikPaymentViewSet", (DrfIdempotencyKeyMixin, PlainPaymentViewSet), {})
    return PlainPaymentViewSet


def bare_get(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b'{"ok":true}', content_type="application/json")
