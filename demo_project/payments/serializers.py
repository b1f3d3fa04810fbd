from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from demo_project.payments import services
from demo_project.payments.models import Account, LedgerEntry, Payment

#: At least 0.01, at most two decimals, no sign, no leading zero, no exponent: "25.00".
AMOUNT_PATTERN = r"^(?:[1-9][0-9]{0,11}(?:\.[0-9]{1,2})?|0\.(?:[1-9][0-9]?|0[1-9]))$"


@extend_schema_field(
    {"type": "string", "format": "decimal", "pattern": AMOUNT_PATTERN, "example": "25.00"}
)
class AmountField(serializers.DecimalField):
    """Money as a string of digits ("25.00"), exactly as the schema's pattern says: a JSON number
    would have passed through a binary float on its way."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=14, decimal_places=2, min_value=Decimal("0.01"), **kwargs)

    def to_internal_value(self, data: Any) -> Decimal:
        if not isinstance(data, str) or not re.fullmatch(AMOUNT_PATTERN, data):
            self.fail("invalid")
        return super().to_internal_value(data)


class AccountSerializer(serializers.ModelSerializer[Account]):
    class Meta:
        model = Account
        fields = ["name", "balance", "currency"]


class PaymentSerializer(serializers.ModelSerializer[Payment]):
    source_account = serializers.SlugRelatedField(slug_field="name", queryset=Account.objects.all())
    destination_account = serializers.SlugRelatedField(
        slug_field="name", queryset=Account.objects.all()
    )
    amount = AmountField()
    currency = serializers.CharField(min_length=3, max_length=3)

    class Meta:
        model = Payment
        fields = [
            "transaction_id",
            "amount",
            "currency",
            "source_account",
            "destination_account",
            "status",
            "processed_at",
        ]
        read_only_fields = ["transaction_id", "status", "processed_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        source, destination = attrs["source_account"], attrs["destination_account"]
        if source == destination:
            raise serializers.ValidationError("source and destination must differ")
        for account in (source, destination):
            if account.currency != attrs["currency"]:
                raise serializers.ValidationError(
                    {"currency": [f"{account.name} holds {account.currency}."]}
                )
        return attrs

    def create(self, validated_data: dict[str, Any]) -> Payment:
        return services.create_payment(
            amount=validated_data["amount"],
            currency=validated_data["currency"],
            source=validated_data["source_account"],
            destination=validated_data["destination_account"],
            fault=self.context.get("fault"),
        )


class PaymentStatusSerializer(serializers.ModelSerializer[Payment]):
    status = serializers.ChoiceField(
        choices=[Payment.Status.REFUNDED.value, Payment.Status.DISPUTED.value]
    )

    class Meta:
        model = Payment
        fields = ["transaction_id", "status", "processed_at"]
        read_only_fields = ["transaction_id", "processed_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # PATCH validates partially, which skips required fields; but status is the one thing
        # this serializer changes, so a PATCH without it is a field error, not a no-op.
        if "status" not in attrs:
            raise serializers.ValidationError(
                {"status": [self.fields["status"].error_messages["required"]]}, code="required"
            )
        return attrs

    def update(self, instance: Payment, validated_data: dict[str, Any]) -> Payment:
        return services.change_status(
            instance, validated_data["status"], fault=self.context.get("fault")
        )


class LedgerEntrySerializer(serializers.ModelSerializer[LedgerEntry]):
    payment = serializers.SlugRelatedField(slug_field="transaction_id", read_only=True)
    account = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = LedgerEntry
        fields = [
            "id",
            "payment",
            "event_id",
            "topic",
            "account",
            "side",
            "amount",
            "currency",
            "recorded_at",
        ]
        read_only_fields = fields
