from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from demo_project.payments.models import Account

DEMO_USER = "demo"
DEMO_PASSWORD = "demo-password"  # noqa: S105 - printed for the quick start on purpose
OPENING_BALANCE = Decimal("1000.00")


class Command(BaseCommand):
    help = (
        "Migrate, create the demo admin user and seed accounts acc_1 ... acc_N. Safe to run "
        "again: existing users and accounts are left as they are."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--accounts", type=int, default=5, help="How many accounts to seed.")

    def handle(self, *args: Any, accounts: int, verbosity: int, **options: Any) -> None:
        call_command("migrate", interactive=False, verbosity=max(verbosity - 1, 0))
        user_model = get_user_model()
        user, created = user_model.objects.get_or_create(
            username=DEMO_USER, defaults={"is_staff": True, "is_superuser": True}
        )
        if created:
            user.set_password(DEMO_PASSWORD)
            user.save()
        for number in range(1, accounts + 1):
            Account.objects.get_or_create(
                name=f"acc_{number}", defaults={"balance": OPENING_BALANCE}
            )
        if verbosity:
            self.stdout.write(
                f"Demo admin user: {DEMO_USER} / {DEMO_PASSWORD}\n"
                f"Accounts: acc_1 ... acc_{accounts}, {OPENING_BALANCE} USD each when created"
            )
