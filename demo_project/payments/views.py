from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from rest_framework import exceptions, generics, mixins, serializers, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from demo_project.payments import faults
from demo_project.payments.models import Account, LedgerEntry, Payment
from demo_project.payments.serializers import (
    AccountSerializer,
    LedgerEntrySerializer,
    PaymentSerializer,
    PaymentStatusSerializer,
)
from django_idempotency.conf import conf
from django_idempotency.drf import IdempotencyMixin


class PaymentViewSet(
    IdempotencyMixin,
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.ListModelMixin,
    viewsets.GenericViewSet[Payment],
):
    """POST moves money; PATCH refunds or disputes a payment. Both need an Idempotency-Key."""

    queryset = Payment.objects.select_related("source_account", "destination_account").order_by(
        "-processed_at"
    )
    lookup_field = "transaction_id"
    # Any value reaches the view, which answers a malformed one with DRF's JSON 404; the
    # router's default pattern would leave it to Django's HTML 404 page.
    lookup_value_regex = "[^/]+"
    http_method_names = ["get", "post", "patch", "head", "options"]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # Read the fault before the key is claimed: a malformed header is then a plain 400 that
        # leaves the key free, rather than a stored answer.
        self.fault = faults.from_request(request)
        super().initial(request, *args, **kwargs)

    def get_serializer_class(self) -> Any:
        if self.action == "partial_update":
            return PaymentStatusSerializer
        return PaymentSerializer

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "fault": getattr(self, "fault", None)}


class AccountViewSet(viewsets.ReadOnlyModelViewSet[Account]):
    queryset = Account.objects.order_by("name")
    serializer_class = AccountSerializer
    lookup_field = "name"
    lookup_value_regex = "[^/]+"


class LedgerEntryViewSet(viewsets.ReadOnlyModelViewSet[LedgerEntry]):
    """The entries the ledger consumer wrote from the payment events, oldest first.

    Filter with ``?payment=<transaction_id>`` and ``?account=<name>``.
    """

    queryset = LedgerEntry.objects.select_related("payment", "account").order_by("id")
    serializer_class = LedgerEntrySerializer
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[LedgerEntry]:
        queryset = super().get_queryset()
        payment = self.request.query_params.get("payment")
        if payment is not None:
            try:
                queryset = queryset.filter(payment__transaction_id=uuid.UUID(payment))
            except ValueError:
                raise exceptions.ValidationError(
                    {"payment": [f"{payment!r} is not a transaction_id (a UUID)."]}
                ) from None
        account = self.request.query_params.get("account")
        if account is not None:
            queryset = queryset.filter(account__name=account)
        return queryset


class DemoInfoSerializer(serializers.Serializer[dict[str, Any]]):
    lease_seconds = serializers.FloatField(help_text="IDEMPOTENCY['LEASE_SECONDS']")
    ttl_seconds = serializers.FloatField(help_text="IDEMPOTENCY['TTL_SECONDS']")
    faults = serializers.BooleanField(help_text="Whether X-Demo-Fault is honoured (DEMO_FAULTS).")
    fast_path = serializers.BooleanField(help_text="Whether the Redis fast path is configured.")
    broker = serializers.BooleanField(help_text="Whether tasks go to a broker.")
    database = serializers.CharField(help_text="The database backend in use.")


class DemoInfoView(generics.GenericAPIView[Any]):
    """What this demo server runs with, so the tour knows which steps it can show."""

    serializer_class = DemoInfoSerializer

    def get(self, request: Request) -> Response:
        info = {
            "lease_seconds": conf.LEASE_SECONDS,
            "ttl_seconds": conf.TTL_SECONDS,
            "faults": settings.DEMO_FAULTS,
            "fast_path": conf.CACHE_ALIAS is not None,
            "broker": bool(settings.CELERY_BROKER_URL),
            "database": settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1],
        }
        return Response(self.get_serializer(info).data)
