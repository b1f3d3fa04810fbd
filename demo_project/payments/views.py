from __future__ import annotations

from typing import Any

from rest_framework import mixins, viewsets

from demo_project.payments.models import Account, Payment
from demo_project.payments.serializers import (
    AccountSerializer,
    PaymentSerializer,
    PaymentStatusSerializer,
)
from django_idempotency.drf import IdempotencyMixin


class PaymentViewSet(
    IdempotencyMixin,
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.ListModelMixin,
    viewsets.GenericViewSet[Payment],
):
    """POST moves money; PATCH changes a payment's status. Both need an Idempotency-Key."""

    queryset = Payment.objects.select_related("source_account", "destination_account")
    lookup_field = "transaction_id"
    http_method_names = ["get", "post", "patch", "head", "options"]

    def get_serializer_class(self) -> Any:
        if self.action == "partial_update":
            return PaymentStatusSerializer
        return PaymentSerializer


class AccountViewSet(viewsets.ReadOnlyModelViewSet[Account]):
    queryset = Account.objects.order_by("name")
    serializer_class = AccountSerializer
    lookup_field = "name"
