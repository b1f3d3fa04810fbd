from __future__ import annotations

import uuid

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils.translation import gettext_lazy as _

from django_idempotency.core.failures import FailureKind
from django_idempotency.core.types import MAX_KEY_LENGTH, MAX_SCOPE_LENGTH
from django_idempotency.db.querysets import (
    FailedMessageQuerySet,
    IdempotencyRecordQuerySet,
    OutboxEventQuerySet,
    OutboxKeyLockQuerySet,
    OutboxStatus,
    ProcessedMessageQuerySet,
    RecordStatus,
)

__all__ = [
    "FailedMessage",
    "IdempotencyRecord",
    "OutboxEvent",
    "OutboxKeyLock",
    "ProcessedMessage",
]


class IdempotencyRecord(models.Model):
    """One idempotency key in one scope: who holds it, and the response once it completed."""

    Status = RecordStatus

    scope = models.CharField(
        _("scope"),
        max_length=MAX_SCOPE_LENGTH,
        help_text=_(
            "Who sent the key (by default the user); the same key in two scopes is two records."
        ),
    )
    key = models.CharField(
        _("key"),
        max_length=MAX_KEY_LENGTH,
        help_text=_("The Idempotency-Key header as the client sent it."),
    )
    fingerprint = models.CharField(
        _("fingerprint"),
        max_length=64,
        help_text=_("SHA-256 of method, path and canonical body; a retry must match it."),
    )
    status = models.CharField(
        _("status"),
        max_length=16,
        choices=RecordStatus.choices,
        default=RecordStatus.PROCESSING,
        help_text=_(
            "PROCESSING while a request holds the lease, COMPLETED once its response is stored, "
            "ACCEPTED while a worker holds it for a request that answered 202."
        ),
    )
    owner_token = models.UUIDField(
        _("owner token"),
        help_text=_(
            "Fencing token of the request holding the key; only it may complete or release it."
        ),
    )
    lease_expires_at = models.DateTimeField(
        _("lease expires at"),
        null=True,
        blank=True,
        help_text=_("Until then a retry gets 409; after it, a retry takes the key over."),
    )
    attempts = models.PositiveIntegerField(
        _("attempts"), default=1, help_text=_("How many requests have held this key.")
    )
    method = models.CharField(
        _("method"), max_length=16, help_text=_("HTTP method of the request.")
    )
    path = models.TextField(_("path"), help_text=_("Path and query string of the request."))
    response_status = models.PositiveSmallIntegerField(
        _("response status"), null=True, blank=True, help_text=_("Status code replayed to retries.")
    )
    response_headers = models.JSONField(
        _("response headers"),
        default=list,
        blank=True,
        help_text=_("Stored [name, value] pairs from STORED_RESPONSE_HEADERS."),
    )
    response_body = models.BinaryField(
        _("response body"), null=True, blank=True, help_text=_("Body bytes replayed to retries.")
    )
    response_retained = models.BooleanField(
        _("response retained"),
        default=True,
        help_text=_("False when the body was streamed or larger than MAX_RESPONSE_BYTES."),
    )
    created_at = models.DateTimeField(
        _("created at"), help_text=_("When the key was first claimed.")
    )
    completed_at = models.DateTimeField(
        _("completed at"), null=True, blank=True, help_text=_("When the response was stored.")
    )
    expires_at = models.DateTimeField(
        _("expires at"),
        help_text=_("After this the record counts as absent and the sweep deletes it."),
    )

    objects = IdempotencyRecordQuerySet.as_manager()

    class Meta:
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")
        constraints = [
            models.UniqueConstraint(
                fields=["scope", "key"], name="django_idempotency_scope_key_uniq"
            ),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="django_idempotency_expires_idx"),
            models.Index(
                fields=["status", "lease_expires_at"], name="django_idempotency_lease_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope} / {self.key} ({self.status})"


class FailureColumns(models.Model):
    """Why a row is failing, in the same columns for outbox events and inbox messages: the admin's
    failure groups read both alike.

    Nullable with no default: adding them is then a catalog-only change on every backend, never
    a rewrite of a large table. NULL while the row is not failing.
    """

    last_error = models.TextField(
        _("last error"),
        blank=True,
        default="",
        help_text=_("Why the last attempt failed: the exception's type and text."),
    )
    failure_fingerprint = models.CharField(  # noqa: DJ001
        _("failure fingerprint"),
        max_length=32,  # core.failures.FINGERPRINT_LENGTH
        null=True,
        blank=True,
        help_text=_(
            "Hash of the last error with ids, numbers and timestamps normalised away: the "
            "failure group the admin lists the row in. Empty while it is not failing."
        ),
    )
    failing_since = models.DateTimeField(
        _("failing since"),
        null=True,
        blank=True,
        help_text=_("When the row first failed with its current failure fingerprint."),
    )
    last_failed_at = models.DateTimeField(
        _("last failed at"),
        null=True,
        blank=True,
        help_text=_("When the latest attempt failed."),
    )
    failure_traceback = models.TextField(  # noqa: DJ001
        _("failure traceback"),
        null=True,
        blank=True,
        help_text=_(
            "Where the latest failure was raised: its frames, bounded in size; the messages "
            "of the exceptions it was raised from are not stored."
        ),
    )

    class Meta:
        abstract = True


class OutboxEvent(FailureColumns):
    """An event written in the business transaction, waiting for the relay to publish it."""

    Status = OutboxStatus

    event_id = models.UUIDField(
        _("event id"),
        default=uuid.uuid4,
        help_text=_(
            "Stable id of the event, sent as the broker's message id; consumers deduplicate on it."
        ),
    )
    topic = models.CharField(
        _("topic"),
        max_length=255,
        help_text=_("What happened, for example 'orders.paid'; OUTBOX_PUBLISHERS routes on it."),
    )
    key = models.CharField(
        _("key"),
        max_length=255,
        blank=True,
        default="",
        help_text=_(
            "Ordering key, for example an aggregate id: events with the same key leave in "
            "order. Empty for events with no order."
        ),
    )
    payload = models.JSONField(
        _("payload"), encoder=DjangoJSONEncoder, help_text=_("The event's body, as JSON.")
    )
    headers = models.JSONField(
        _("headers"),
        encoder=DjangoJSONEncoder,
        default=dict,
        blank=True,
        help_text=_("Extra message headers passed to the publisher."),
    )
    status = models.CharField(
        _("status"),
        max_length=16,
        choices=OutboxStatus.choices,
        default=OutboxStatus.PENDING,
        help_text=_(
            "PENDING until published; DEAD after OUTBOX_MAX_ATTEMPTS failures, until "
            "retried; HELD while an earlier event of its key is DEAD or waits for a retry."
        ),
    )
    attempts = models.PositiveIntegerField(
        _("attempts"), default=0, help_text=_("How many times publishing this event failed.")
    )
    next_attempt_at = models.DateTimeField(
        _("next attempt at"),
        help_text=_(
            "After a failure, the relay leaves the event alone until then (backoff). An event "
            "that has not failed is due at once."
        ),
    )
    locked_until = models.DateTimeField(
        _("locked until"),
        null=True,
        blank=True,
        help_text=_("Lease of the relay publishing the event; after it another relay may."),
    )
    relay_token = models.UUIDField(
        _("relay token"),
        null=True,
        blank=True,
        help_text=_("Fencing token of the relay holding the lease; only it may mark the event."),
    )
    # Deprecated: kept (always 0) because the relay index starts with it; see db/querysets.py.
    transaction_id = models.BigIntegerField(
        _("transaction id"),
        default=0,
        help_text=_(
            "Deprecated, always 0. Earlier versions stored the inserting PostgreSQL "
            "transaction's id here; events now leave in id order."
        ),
    )
    created_at = models.DateTimeField(_("created at"), help_text=_("When the event was written."))
    # Nullable with no default: adding the column is then a catalog-only change on every
    # backend (SQLite included), never a rewrite of a large outbox table. NULL means "no trace".
    traceparent = models.CharField(  # noqa: DJ001
        _("traceparent"),
        max_length=128,
        null=True,
        blank=True,
        help_text=_(
            "W3C traceparent of the span that published the event (an HTTP request, say); "
            "publishers send it with the message so the consumer's span links back to it."
        ),
    )
    published_at = models.DateTimeField(
        _("published at"),
        null=True,
        blank=True,
        help_text=_("When the broker accepted the event."),
    )
    failure_kind = models.CharField(  # noqa: DJ001
        _("failure kind"),
        max_length=16,
        choices=FailureKind.choices,
        null=True,
        blank=True,
        help_text=_(
            "Why the latest attempt failed: unreachable (the broker could not be reached), "
            "configuration (the broker refused the route: credentials, permissions, a missing "
            "stream or exchange; retried only every OUTBOX_BACKOFF_MAX_SECONDS, never DEAD for "
            "it) or other. Empty once published or retried."
        ),
    )

    objects = OutboxEventQuerySet.as_manager()

    class Meta:
        verbose_name = _("outbox event")
        verbose_name_plural = _("outbox events")
        constraints = [
            models.UniqueConstraint(
                fields=["event_id"], name="django_idempotency_outbox_event_id_uniq"
            ),
        ]
        indexes = [
            # The relay's claim walks PENDING events in relay order and stops after a batch,
            # whatever the backlog; due-ness and leases are checked on the way.
            models.Index(
                fields=["status", "transaction_id", "id"], name="django_idem_outbox_relay_idx"
            ),
            # The per-key order check: earlier unpublished events with the same key, without
            # reading the key's published history.
            models.Index(
                fields=["key", "status", "transaction_id", "id"],
                name="django_idem_outbox_key_idx",
            ),
            # The sweep of published events past OUTBOX_RETENTION_SECONDS.
            models.Index(fields=["status", "published_at"], name="django_idem_outbox_sweep_idx"),
            # Failure groups: grouping reads only the entries of failing events (the others are
            # NULL), a group's events are one range, and its newest failure is the range's end.
            models.Index(
                fields=["failure_fingerprint", "last_failed_at"],
                name="django_idem_outbox_failure_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.topic} {self.event_id} ({self.status})"


class OutboxKeyLock(models.Model):
    """A bucket of ordering keys whose row a publishing transaction locks on MariaDB and MySQL.

    ``publish(key=...)`` locks its key's bucket until the transaction ends, so transactions that
    publish one key take turns and their events' ids follow their commits. PostgreSQL uses an
    advisory lock and SQLite its write lock instead; the table exists everywhere and stays
    empty there. Never shown in the admin.
    """

    bucket = models.PositiveIntegerField(
        _("bucket"),
        primary_key=True,
        help_text=_("CRC-32 of the ordering key modulo 65,536; keys that share it take turns."),
    )

    objects = OutboxKeyLockQuerySet.as_manager()

    class Meta:
        verbose_name = _("outbox key lock")
        verbose_name_plural = _("outbox key locks")

    def __str__(self) -> str:
        return f"outbox key bucket {self.bucket}"


class ProcessedMessage(models.Model):
    """A message a consumer has handled: the inbox that makes redeliveries harmless."""

    consumer = models.CharField(
        _("consumer"),
        max_length=255,
        help_text=_("Who handled the message, by default the Celery task's name."),
    )
    message_id = models.CharField(
        _("message id"),
        max_length=255,
        help_text=_("The message's id: the outbox event id, or the broker's message id."),
    )
    processed_at = models.DateTimeField(
        _("processed at"),
        help_text=_("When the handler committed; the sweep deletes it after INBOX_RETENTION."),
    )

    objects = ProcessedMessageQuerySet.as_manager()

    class Meta:
        verbose_name = _("processed message")
        verbose_name_plural = _("processed messages")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "message_id"],
                name="django_idempotency_consumer_message_uniq",
            ),
        ]
        indexes = [
            models.Index(fields=["processed_at"], name="django_idem_processed_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.consumer} / {self.message_id}"


class FailedMessage(FailureColumns):
    """A message whose handler raised, until it is handled or an operator forgets it.

    Written after the handler's transaction rolled back (so it survives it), in a transaction of
    its own; deleted in the transaction that finally handles the message. The admin groups these
    by failure fingerprint like failed outbox events. The message itself lives in the broker,
    which redelivers it; this row only says why handling it failed.
    """

    consumer = models.CharField(
        _("consumer"),
        max_length=255,
        help_text=_("Who failed to handle the message, by default the Celery task's name."),
    )
    message_id = models.CharField(
        _("message id"),
        max_length=255,
        help_text=_("The message's id: the outbox event id, or the broker's message id."),
    )
    attempts = models.PositiveIntegerField(
        _("attempts"), default=1, help_text=_("How many times handling the message failed.")
    )
    objects = FailedMessageQuerySet.as_manager()

    class Meta:
        verbose_name = _("failed message")
        verbose_name_plural = _("failed messages")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "message_id"],
                name="django_idempotency_failed_message_uniq",
            ),
        ]
        indexes = [
            models.Index(
                fields=["failure_fingerprint", "last_failed_at"],
                name="django_idem_failed_msg_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.consumer} / {self.message_id} (failed {self.attempts}x)"
