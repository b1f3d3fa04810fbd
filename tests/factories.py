from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from django_idempotency.engine import Identity
from django_idempotency.models import IdempotencyRecord


class UserFactory(factory.django.DjangoModelFactory):  # type: ignore[misc]
    class Meta:
        model = get_user_model()

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("pw")


class IdempotencyRecordFactory(factory.django.DjangoModelFactory):  # type: ignore[misc]
    """A record in any state: PROCESSING with a running lease by default."""

    class Meta:
        model = IdempotencyRecord

    class Params:
        now = factory.LazyFunction(timezone.now)

    scope = "anonymous"
    key = factory.Sequence(lambda n: f"key-{n}")
    fingerprint = "0" * 64
    status = IdempotencyRecord.Status.PROCESSING
    owner_token = factory.LazyFunction(uuid.uuid4)
    lease_expires_at = factory.LazyAttribute(lambda o: o.now + timedelta(seconds=30))
    method = "POST"
    path = "/api/widget/"
    created_at = factory.LazyAttribute(lambda o: o.now)
    expires_at = factory.LazyAttribute(lambda o: o.now + timedelta(days=1))


def identity(**overrides: Any) -> Identity:
    values: dict[str, Any] = {
        "scope": "anonymous",
        "key": f"key-{uuid.uuid4()}",
        "fingerprint": "f" * 64,
        "method": "POST",
        "path": "/api/widget/",
    }
    values.update(overrides)
    return Identity(**values)
