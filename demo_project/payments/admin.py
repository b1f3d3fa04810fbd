from typing import Any

from django.contrib import admin

from demo_project.payments.models import Account, LedgerEntry, Payment


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ["name", "balance", "currency"]


@admin.register(Payment)
class PaymentAdmin(admin.ModelAdmin):
    list_display = [
        "transaction_id",
        "amount",
        "currency",
        "source_account",
        "destination_account",
        "status",
        "processed_at",
    ]
    list_filter = ["status"]


@admin.register(LedgerEntry)
class LedgerEntryAdmin(admin.ModelAdmin):
    """Read-only: only the ledger consumer writes entries."""

    list_display = ["recorded_at", "topic", "account", "side", "amount", "currency", "payment"]
    list_filter = ["topic", "side"]

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False
