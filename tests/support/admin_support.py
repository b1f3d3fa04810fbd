"""Helpers shared by the admin tests: staff users with given permissions, actions, messages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.admin import helpers
from django.contrib.auth.models import Permission, User
from django.test import Client


def login(*codenames: str, superuser: bool = False) -> Client:
    """A client logged in as a staff user with these django_idempotency permissions."""
    user = User.objects.create_user(f"user-{User.objects.count()}", is_staff=True)
    user.is_superuser = superuser
    user.save()
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_idempotency", codename__in=codenames
        )
    )
    client = Client()
    client.force_login(user)
    return client


def post_action(client: Client, url: str, name: str, objects: Iterable[Any], **extra: str) -> Any:
    """Run an admin action on ``objects`` from the changelist at ``url``, following redirects.

    ``post="yes"`` stands for the confirmation page's answer.
    """
    data = {"action": name, helpers.ACTION_CHECKBOX_NAME: [obj.pk for obj in objects], **extra}
    if "post" not in extra:
        data["index"] = "0"
    return client.post(url, data, follow=True)


def messages_of(response: Any) -> list[str]:
    return [f"{m.level_tag}: {m}" for m in response.context["messages"]]
