from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
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
from django_idempotency.request.handoff import hand_off


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


class AcceptedSerializer(serializers.Serializer[dict[str, Any]]):
    key = serializers.CharField(help_text="The request's Idempotency-Key.")
    status = serializers.CharField(help_text="processing")
    status_url = serializers.CharField(help_text="The key's status URL, also in Location.")


class PayoutView(IdempotencyMixin, generics.GenericAPIView[Payment]):
    """POST a payout: the body of a payment, the money moved by a worker a few seconds later.

    The answer is 202 at once, with ``Location`` the key's status URL; the worker stores the
    final answer (201 and the payment, as ``POST /api/v1/payments/`` gives it) under the same
    key. A retry gets the 202 until then (or, with ``Prefer: wait=N``, waits for the final
    answer), and the final answer after.
    """

    serializer_class = PaymentSerializer
    idempotency_long_running = True

    @extend_schema(
        responses={
            202: OpenApiResponse(AcceptedSerializer, description="Handed to the worker."),
            201: OpenApiResponse(
                PaymentSerializer, description="A retry, once the worker has paid it out."
            ),
        }
    )
    def post(self, request: Request) -> HttpResponse:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        payout = serializer.validated_data
        return hand_off(
            request,
            "payout.requested",
            amount=str(payout["amount"]),
            currency=payout["currency"],
            source_account=payout["source_account"].name,
            destination_account=payout["destination_account"].name,
        )


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
    redis_copy = serializers.BooleanField(help_text="Whether the Redis copy is configured.")
    broker = serializers.BooleanField(help_text="Whether tasks go to a broker.")
    database = serializers.CharField(help_text="The database backend in use.")
    payout_seconds = serializers.FloatField(help_text="How long a payout takes in the worker.")


class DemoInfoView(generics.GenericAPIView[Any]):
    """What this demo server runs with, so the tour knows which steps it can show."""

    serializer_class = DemoInfoSerializer

    def get(self, request: Request) -> Response:
        info = {
            "lease_seconds": conf.LEASE_SECONDS,
            "ttl_seconds": conf.TTL_SECONDS,
            "faults": settings.DEMO_FAULTS,
            "redis_copy": conf.CACHE_ALIAS is not None,
            "broker": bool(settings.CELERY_BROKER_URL),
            "database": settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1],
            "payout_seconds": settings.DEMO_PAYOUT_SECONDS,
        }
        return Response(self.get_serializer(info).data)
