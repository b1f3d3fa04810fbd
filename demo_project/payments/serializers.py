from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db.models import F
from rest_framework import serializers

from demo_project.payments.models import Account, Payment


class AccountSerializer(serializers.ModelSerializer[Account]):
    class Meta:
        model = Account
        fields = ["name", "balance", "currency"]


class PaymentSerializer(serializers.ModelSerializer[Payment]):
    source_account = serializers.SlugRelatedField(slug_field="name", queryset=Account.objects.all())
    destination_account = serializers.SlugRelatedField(
        slug_field="name", queryset=Account.objects.all()
    )
    amount = serializers.DecimalField(max_digits=14, decimal_places=2, min_value=Decimal("0.01"))

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
        if attrs["source_account"] == attrs["destination_account"]:
            raise serializers.ValidationError("source and destination must differ")
        return attrs

    def create(self, validated_data: dict[str, Any]) -> Payment:
        amount = validated_data["amount"]
        Account.objects.filter(pk=validated_data["source_account"].pk).update(
            balance=F("balance") - amount
        )
        Account.objects.filter(pk=validated_data["destination_account"].pk).update(
            balance=F("balance") + amount
        )
        return super().create(validated_data)


class PaymentStatusSerializer(serializers.ModelSerializer[Payment]):
    class Meta:
        model = Payment
        fields = ["transaction_id", "status", "processed_at"]
        read_only_fields = ["transaction_id", "processed_at"]
