"""Named queries the record store, the sweeps and the admin share."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import Q
from django.utils import timezone

from django_idempotency.core import statemachine

if TYPE_CHECKING:
    from django_idempotency.models import (  # noqa: F401  (named in strings)
        IdempotencyRecord,
        OutboxEvent,
        ProcessedMessage,
    )


class RecordStatus(models.TextChoices):
    PROCESSING = statemachine.PROCESSING, "Processing"
    COMPLETED = statemachine.COMPLETED, "Completed"


PROCESSING = RecordStatus.PROCESSING
COMPLETED = RecordStatus.COMPLETED


# The rules of core/statemachine.py as filters; tests/test_statemachine.py holds them equal.


def lease_running_q(now: datetime) -> Q:
    """``statemachine.lease_running``: PROCESSING with a lease that has not run out."""
    return Q(status=PROCESSING, lease_expires_at__isnull=False, lease_expires_at__gt=now)


def lease_expired_q(now: datetime) -> Q:
    """PROCESSING, and its lease has run out: the request died or overran (a "stuck" key)."""
    return Q(status=PROCESSING) & (Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now))


def expired_q(now: datetime) -> Q:
    """``statemachine.is_expired``: past TTL, and not a request whose lease still runs."""
    return Q(expires_at__lte=now) & (
        ~Q(status=PROCESSING) | Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now)
    )


def stale_q(now: datetime, fingerprint: str) -> Q:
    """What ``Verdict.TAKE_OVER`` may replace: the same request, its lease run out."""
    return lease_expired_q(now) & Q(fingerprint=fingerprint)


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


# --- Layer 3: the outbox -----------------------------------------------------------------------


class OutboxStatus(models.TextChoices):
    PENDING = "PENDING", "Pending"
    PUBLISHED = "PUBLISHED", "Published"
    DEAD = "DEAD", "Dead"


#: Statuses that still hold back later events with the same key: a DEAD event keeps its key's
#: order until someone retries or discards it.
UNPUBLISHED = (OutboxStatus.PENDING, OutboxStatus.DEAD)

#: The relay's order. ``transaction_id`` is 0 except on PostgreSQL, where it is the inserting
#: transaction's id, so this is "by transaction, then by insertion" there and plain id order
#: elsewhere (see relay.py for why).
RELAY_ORDER = ("transaction_id", "id")


def lease_free_q(now: datetime) -> Q:
    return Q(locked_until__isnull=True) | Q(locked_until__lte=now)


def earlier_than_q(transaction_id: Any, pk: Any) -> Q:
    """Rows before (transaction_id, pk) in relay order; accepts ``OuterRef`` expressions."""
    return Q(transaction_id__lt=transaction_id) | Q(transaction_id=transaction_id, id__lt=pk)


class OutboxEventQuerySet(models.QuerySet["OutboxEvent"]):
    def pending(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.PENDING)

    def published(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.PUBLISHED)

    def dead(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.DEAD)

    def unpublished(self) -> OutboxEventQuerySet:
        return self.filter(status__in=UNPUBLISHED)

    def due(self, now: datetime | None = None) -> OutboxEventQuerySet:
        """PENDING, its next attempt has come, and no relay holds a lease on it."""
        now = now or timezone.now()
        return self.filter(lease_free_q(now), status=OutboxStatus.PENDING, next_attempt_at__lte=now)

    def failed(self) -> OutboxEventQuerySet:
        """DEAD events, and PENDING ones that failed at least once and wait for their retry."""
        return self.filter(
            Q(status=OutboxStatus.DEAD) | Q(status=OutboxStatus.PENDING, attempts__gt=0)
        )

    def leased(self, now: datetime | None = None) -> OutboxEventQuerySet:
        """Claimed by a relay whose lease still runs."""
        return self.filter(status=OutboxStatus.PENDING, locked_until__gt=now or timezone.now())

    def published_before(self, cutoff: datetime) -> OutboxEventQuerySet:
        """What the sweep deletes: published longer ago than the retention."""
        return self.filter(status=OutboxStatus.PUBLISHED, published_at__lt=cutoff)

    def in_relay_order(self) -> OutboxEventQuerySet:
        return self.order_by(*RELAY_ORDER)


# --- Layer 2: idempotent consumers -------------------------------------------------------------


class ProcessedMessageQuerySet(models.QuerySet["ProcessedMessage"]):
    def for_message(self, consumer: str, message_id: str) -> ProcessedMessageQuerySet:
        return self.filter(consumer=consumer, message_id=message_id)

    def processed_before(self, cutoff: datetime) -> ProcessedMessageQuerySet:
        """What the sweep deletes: processed longer ago than the retention."""
        return self.filter(processed_at__lt=cutoff)
