"""Named queries the record store, the sweeps and the admin share."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import Count, Exists, F, Max, Min, Q
from django.utils import timezone

from django_idempotency.core import leases, statemachine

__all__ = [
    "ACCEPTED",
    "COMPLETED",
    "FailedMessageQuerySet",
    "IdempotencyRecordQuerySet",
    "OUTBOX_KEY_BUCKETS",
    "OutboxEventQuerySet",
    "OutboxKeyLockQuerySet",
    "OutboxStatus",
    "PROCESSING",
    "ProcessedMessageQuerySet",
    "RELAY_ORDER",
    "RecordStatus",
    "UNPUBLISHED",
    "backing_off_q",
    "earlier_unpublished",
    "Moment",
    "key_bucket",
    "lease_free_q",
]

if TYPE_CHECKING:
    from django_idempotency.models import (  # noqa: F401  (named in strings)
        FailedMessage,
        IdempotencyRecord,
        OutboxEvent,
        OutboxKeyLock,
        ProcessedMessage,
    )


class RecordStatus(models.TextChoices):
    PROCESSING = statemachine.PROCESSING, "Processing"
    COMPLETED = statemachine.COMPLETED, "Completed"
    ACCEPTED = statemachine.ACCEPTED, "Accepted (handed to a worker)"


PROCESSING = RecordStatus.PROCESSING
COMPLETED = RecordStatus.COMPLETED
ACCEPTED = RecordStatus.ACCEPTED


class IdempotencyRecordQuerySet(models.QuerySet["IdempotencyRecord"]):
    def for_key(self, scope: str, key: str) -> IdempotencyRecordQuerySet:
        return self.filter(scope=scope, key=key)

    def processing(self) -> IdempotencyRecordQuerySet:
        return self.filter(status=PROCESSING)

    def completed(self) -> IdempotencyRecordQuerySet:
        return self.filter(status=COMPLETED)

    # The lease rule's ORM form (``core/leases.py``): by the database's clock unless given a
    # time read from it.

    def stuck(self, now: leases.Moment = None) -> IdempotencyRecordQuerySet:
        """Held records whose lease ran out: the request (or its worker) died or overran."""
        return self.filter(leases.run_out_q(now))

    def lease_active(self, now: leases.Moment = None) -> IdempotencyRecordQuerySet:
        return self.filter(leases.running_q(now))

    def expired(self, now: leases.Moment = None) -> IdempotencyRecordQuerySet:
        """Records past their TTL: claims treat them as absent, the sweep deletes them."""
        return self.filter(leases.expired_q(now))

    def live(self, now: leases.Moment = None) -> IdempotencyRecordQuerySet:
        return self.exclude(leases.expired_q(now))


# --- Layer 3: the outbox -----------------------------------------------------------------------


class OutboxStatus(models.TextChoices):
    PENDING = "PENDING", "Pending"
    PUBLISHED = "PUBLISHED", "Published"
    DEAD = "DEAD", "Dead"
    #: Set aside behind a failed earlier event of its key (outbox/holding.py); PENDING again
    #: once that event is published, retried or discarded.
    HELD = "HELD", "Held (behind a failed event of its key)"


#: Statuses that still hold back later events with the same key: a DEAD event keeps its key's
#: order until someone retries or discards it, and the events HELD behind it keep theirs.
UNPUBLISHED = (OutboxStatus.PENDING, OutboxStatus.DEAD, OutboxStatus.HELD)

#: The relay's order: id order. ``transaction_id`` is a deprecated column, always 0 (migration
#: 0004 zeroed it for unpublished events), kept first so the relay index
#: ``(status, transaction_id, id)`` serves the claim; same-key ids are in commit order because
#: ``publish()`` serialises same-key publishers (see outbox/publish.py).
RELAY_ORDER = ("transaction_id", "id")

#: Ordering keys hash into this many rows of ``OutboxKeyLock`` (MariaDB and MySQL lock the row
#: of the key's bucket), so the table stays small and needs no sweep; two keys that share a
#: bucket only take turns needlessly.
OUTBOX_KEY_BUCKETS = 65_536


def key_bucket(key: str) -> int:
    """The ``OutboxKeyLock`` row of an ordering key: the same on every process and release."""
    return zlib.crc32(key.encode()) % OUTBOX_KEY_BUCKETS


#: A point in time the outbox's filters compare with: a datetime, or an expression the database
#: evaluates (``Now()``: the relay's claim on PostgreSQL judges by the statement's own time).
Moment = datetime | models.Expression


def lease_free_q(now: Moment) -> Q:
    return Q(locked_until__isnull=True) | Q(locked_until__lte=now)


def backing_off_q(now: Moment) -> Q:
    """Waiting for a retry after a failure. An event that never failed waits for no clock, so
    neither a publisher's nor an operator's clock running ahead of the relay's can hold it."""
    return Q(attempts__gt=0, next_attempt_at__gt=now)


def earlier_unpublished(events: models.QuerySet[Any], pk: Any) -> Exists:
    """Whether ``events`` (unpublished events of one key) holds one before ``pk`` in relay
    order (``pk`` may be an ``OuterRef``).

    Among unpublished events relay order is id order: their ``transaction_id`` is always 0. So
    the test is ``id < pk``, one exact range of the index of unpublished events by key and id
    (``django_idem_outbox_unsent_idx``), which ends at ``pk``. A row comparison on
    ``(transaction_id, id)`` said the same, but PostgreSQL ends an index range on a row
    comparison's first column only, so each test read every pending event of the key (10,000
    rows per candidate in a key 10,000 deep)."""
    return Exists(events.filter(pk__lt=pk))


class OutboxEventQuerySet(models.QuerySet["OutboxEvent"]):
    def pending(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.PENDING)

    def published(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.PUBLISHED)

    def dead(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.DEAD)

    def held(self) -> OutboxEventQuerySet:
        return self.filter(status=OutboxStatus.HELD)

    def unpublished(self) -> OutboxEventQuerySet:
        return self.filter(status__in=UNPUBLISHED)

    def due(self, now: Moment | None = None) -> OutboxEventQuerySet:
        """PENDING, not waiting for a retry, and no relay holds a lease on it."""
        now = timezone.now() if now is None else now
        return self.filter(lease_free_q(now), status=OutboxStatus.PENDING).exclude(
            backing_off_q(now)
        )

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

    def in_failure_group(self, fingerprint: str) -> OutboxEventQuerySet:
        """The failed events of one failure group (see ``core/failures.py``)."""
        return self.failed().filter(failure_fingerprint=fingerprint)

    def failure_groups(self) -> models.QuerySet[OutboxEvent, Mapping[str, Any]]:
        """One row per failure group among the failed events here, seen most recently first.

        Each row: ``failure_fingerprint``; ``events`` and ``dead`` (how many of them are DEAD,
        the others wait for a retry); ``topics`` (how many) and ``topic`` (the first by name);
        ``first_seen`` (the earliest ``failing_since``) and ``last_seen`` (the latest
        ``last_failed_at``), None for events fingerprinted by the upgrade, whose failure time
        is unknown. Reads the failure index's entries of failing events only, however large
        the table.
        """
        return (
            self.failed()
            .filter(failure_fingerprint__isnull=False)
            .values("failure_fingerprint")
            .annotate(
                events=Count("pk"),
                dead=Count("pk", filter=Q(status=OutboxStatus.DEAD)),
                topics=Count("topic", distinct=True),
                topic=Min("topic"),
                first_seen=Min("failing_since"),
                last_seen=Max("last_failed_at"),
            )
            .order_by(F("last_seen").desc(nulls_last=True), "failure_fingerprint")
        )


class OutboxKeyLockQuerySet(models.QuerySet["OutboxKeyLock"]):
    def lock(self, key: str) -> None:
        """Lock ``key``'s bucket row until the transaction ends, inserting it on first use.

        The portable form, for backends without a statement of their own in ``db/``: a
        ``SELECT ... FOR UPDATE``, and if the row is missing an INSERT in a savepoint. Two
        transactions inserting the same new row make the second wait for the first; if the
        first committed, the second's INSERT fails and it locks the existing row instead.
        """
        self.select_for_update().get_or_create(bucket=key_bucket(key))


# --- Layer 2: idempotent consumers -------------------------------------------------------------


class ProcessedMessageQuerySet(models.QuerySet["ProcessedMessage"]):
    def for_message(self, consumer: str, message_id: str) -> ProcessedMessageQuerySet:
        return self.filter(consumer=consumer, message_id=message_id)

    def processed_before(self, cutoff: datetime) -> ProcessedMessageQuerySet:
        """What the sweep deletes: processed longer ago than the retention."""
        return self.filter(processed_at__lt=cutoff)


class FailedMessageQuerySet(models.QuerySet["FailedMessage"]):
    def for_message(self, consumer: str, message_id: str) -> FailedMessageQuerySet:
        return self.filter(consumer=consumer, message_id=message_id)

    def in_failure_group(self, fingerprint: str) -> FailedMessageQuerySet:
        return self.filter(failure_fingerprint=fingerprint)

    def failure_groups(self) -> models.QuerySet[FailedMessage, Mapping[str, Any]]:
        """One row per failure group, seen most recently first: ``failure_fingerprint``,
        ``messages``, ``consumers`` (how many) and ``consumer`` (the first by name),
        ``first_seen``, ``last_seen``; as :meth:`OutboxEventQuerySet.failure_groups`."""
        return (
            self.values("failure_fingerprint")
            .annotate(
                messages=Count("pk"),
                consumers=Count("consumer", distinct=True),
                consumer=Min("consumer"),
                first_seen=Min("failing_since"),
                last_seen=Max("last_failed_at"),
            )
            .order_by("-last_seen", "failure_fingerprint")
        )
