from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_idempotency.querysets import IdempotencyRecordQuerySet, RecordStatus


class IdempotencyRecord(models.Model):
    """One idempotency key in one scope: who holds it, and the response once it completed."""

    Status = RecordStatus

    scope = models.CharField(
        _("scope"),
        max_length=255,
        help_text=_(
            "Who sent the key (by default the user); the same key in two scopes is two records."
        ),
    )
    key = models.CharField(
        _("key"), max_length=255, help_text=_("The Idempotency-Key header as the client sent it.")
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
            "PROCESSING while a request holds the lease, COMPLETED once its response is stored."
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
