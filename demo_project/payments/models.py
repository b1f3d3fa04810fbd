from __future__ import annotations

import uuid
from decimal import Decimal

from django.db import models


class Account(models.Model):
    name = models.CharField(max_length=32, unique=True)
    balance = models.DecimalField(max_digits=14, decimal_places=2, default=Decimal("0.00"))
    currency = models.CharField(max_length=3, default="USD")

    def __str__(self) -> str:
        return self.name


class Payment(models.Model):
    class Status(models.TextChoices):
        COMPLETED = "completed"
        REFUNDED = "refunded"
        DISPUTED = "disputed"

    transaction_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    amount = models.DecimalField(max_digits=14, decimal_places=2)
    currency = models.CharField(max_length=3)
    source_account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="+")
    destination_account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="+")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.COMPLETED)
    processed_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return str(self.transaction_id)


class LedgerEntry(models.Model):
    """One side of a money movement, written by the ledger consumer from an outbox event.

    There is deliberately no unique constraint on ``(event_id, side)``: the consumer's
    processed-message marker alone keeps each event to one pair of entries, which is what the
    demo shows and its tests check.
    """

    class Side(models.TextChoices):
        DEBIT = "debit"
        CREDIT = "credit"

    payment = models.ForeignKey(Payment, on_delete=models.PROTECT, related_name="ledger_entries")
    event_id = models.UUIDField(db_index=True, help_text="The outbox event it was written from.")
    topic = models.CharField(max_length=64, help_text="payment.completed or payment.refunded")
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="+")
    side = models.CharField(max_length=6, choices=Side.choices)
    amount = models.DecimalField(max_digits=14, decimal_places=2)
    currency = models.CharField(max_length=3)
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "ledger entries"

    def __str__(self) -> str:
        return f"{self.topic} {self.side} {self.amount} {self.currency}"
