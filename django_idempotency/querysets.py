"""Named queries the engine, the sweeps and the admin share."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from django.db import models
from django.db.models import Q
from django.utils import timezone

if TYPE_CHECKING:
    from django_idempotency.models import IdempotencyRecord  # noqa: F401  (named in a string)


class RecordStatus(models.TextChoices):
    PROCESSING = "PROCESSING", "Processing"
    COMPLETED = "COMPLETED", "Completed"


PROCESSING = RecordStatus.PROCESSING
COMPLETED = RecordStatus.COMPLETED


def lease_expired_q(now: datetime) -> Q:
    return Q(status=PROCESSING, lease_expires_at__lte=now)


def expired_q(now: datetime) -> Q:
    """Past TTL, and not a request whose lease still runs (that one is merely slow)."""
    return Q(expires_at__lte=now) & (Q(status=COMPLETED) | Q(lease_expires_at__lte=now))


class IdempotencyRecordQuerySet(models.QuerySet["IdempotencyRecord"]):
    def for_key(self, scope: str, key: str) -> IdempotencyRecordQuerySet:
        return self.filter(scope=scope, key=key)

    def processing(self) -> IdempotencyRecordQuerySet:
        return self.filter(status=PROCESSING)

    def completed(self) -> IdempotencyRecordQuerySet:
        return self.filter(status=COMPLETED)

    def stuck(self, now: datetime | None = None) -> IdempotencyRecordQuerySet:
        """PROCESSING records whose lease ran out: the request died or overran."""
        return self.filter(lease_expired_q(now or timezone.now()))

    def lease_active(self, now: datetime | None = None) -> IdempotencyRecordQuerySet:
        return self.filter(status=PROCESSING, lease_expires_at__gt=now or timezone.now())

    def expired(self, now: datetime | None = None) -> IdempotencyRecordQuerySet:
        """Records past their TTL: claims treat them as absent, the sweep deletes them."""
        return self.filter(expired_q(now or timezone.now()))

    def live(self, now: datetime | None = None) -> IdempotencyRecordQuerySet:
        return self.exclude(expired_q(now or timezone.now()))
