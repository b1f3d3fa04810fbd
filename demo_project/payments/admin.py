from django.contrib import admin

from demo_project.payments.models import Account, Payment


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
