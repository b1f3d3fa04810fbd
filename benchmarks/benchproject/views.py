"""The payments endpoint in every variant, plus a bare GET for the ceiling."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from rest_framework import mixins, viewsets

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
