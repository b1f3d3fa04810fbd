"""One exception tree. HTTP errors carry their wire code and render as problem+json.

With Django REST framework installed, the HTTP errors are ``APIException`` subclasses, so DRF's
exception handler (or yours) sees them like any other API error and sets ``Retry-After`` from
``wait``. Without DRF they are plain exceptions with the same attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

__all__ = [
    "BrokerConfigurationError",
    "BrokerUnavailable",
    "CredentialsNotScoped",
    "DuplicateEventId",
    "IdempotencyConfigurationError",
    "IdempotencyError",
    "IdempotencyHTTPError",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyMissing",
    "IdempotencyKeyNotFound",
    "IdempotentCallInProgress",
    "IdempotentCallKeyInvalid",
    "IdempotentCallMismatch",
    "IdempotentFunctionError",
    "IdempotentResultNotStorable",
    "LeaseLost",
    "LeaseLostConflict",
    "OutboxError",
    "PartitionMissing",
    "PayloadMismatch",
    "PublishError",
    "ResponseNotRetained",
    "StoreNotMigrated",
    "StoreUnavailable",
    "TransactionInProgress",
    "TransactionRequired",
    "UnroutableTopic",
    "WebhookBodyTooLarge",
    "WebhookIdInvalid",
    "WebhookRejected",
    "WebhookSignatureInvalid",
    "WebhookTimestampStale",
]

if TYPE_CHECKING:
    from rest_framework.exceptions import APIException as _HTTPBase
else:
    try:
        from rest_framework.exceptions import APIException as _HTTPBase
    except ImportError:  # pragma: no cover - exercised only without DRF installed

        class _HTTPBase(Exception):
            status_code = 500
            default_detail = "A server error occurred."
            default_code = "error"

            def __init__(self, detail: Any = None, code: Any = None) -> None:
                self.detail = detail if detail is not None else self.default_detail
                super().__init__(self.detail)


class IdempotencyError(Exception):
    """Base of every error this app raises."""


class IdempotencyConfigurationError(IdempotencyError, ImproperlyConfigured):
    """A setting is wrong; the message names it and the fix."""


class PartitionMissing(IdempotencyError):
    """A claim found no partition of the records table for its time (``RECORD_PARTITIONS``),
    ``publish()`` none of the outbox table (``OUTBOX_PARTITIONS``), or a consumer none of the
    inbox table (``INBOX_PARTITIONS``): the partitions ahead were not created. Nothing was
    written."""


class LeaseLost(IdempotencyError):
    """The completion found another owner on the record: this request's lease was taken over."""


class IdempotencyHTTPError(IdempotencyError, _HTTPBase):
    """An error answered to the client as ``application/problem+json``."""

    title = "Idempotency error"
    #: What the client should do, in a few words: ``message`` beside ``detail``'s explanation.
    default_message = "See detail."
    wait: int | None = None

    def problem(self, type_base: str) -> dict[str, Any]:
        """RFC 9457 body, plus the short ``error`` code clients match on and the ``message``
        that says what to do (``detail`` explains)."""
        code = str(self.default_code)
        return {
            "type": f"{type_base}{code}",
            "title": self.title,
            "status": self.status_code,
            "detail": str(self.detail),
            "error": code,
            "message": self.default_message,
        }


class IdempotencyKeyMissing(IdempotencyHTTPError):
    status_code = 400
    title = "Idempotency key missing"
    default_code = "idempotency_key_missing"
    default_message = "Send an Idempotency-Key header."
    default_detail = "This endpoint requires an Idempotency-Key header."


class IdempotencyKeyInvalid(IdempotencyHTTPError):
    status_code = 400
    title = "Idempotency key invalid"
    default_code = "idempotency_key_invalid"
    default_message = "Send one valid Idempotency-Key."
    default_detail = (
        "The Idempotency-Key header must be sent once, with a key of 1 to 255 characters: "
        "either a bare token of printable ASCII without spaces, commas, double quotes or "
        'backslashes (a UUID is fine), or a double-quoted string of printable ASCII, with \\" '
        "and \\\\ escaped inside and no space at either end of the key."
    )


class TransactionInProgress(IdempotencyHTTPError):
    status_code = 409
    title = "Request in progress"
    default_code = "transaction_in_progress"
    default_message = "Retry with the same key after Retry-After seconds."
    default_detail = (
        "A request with this idempotency key is still being processed. "
        "Retry after the number of seconds in Retry-After."
    )

    def __init__(self, wait: int, detail: Any = None) -> None:
        super().__init__(detail)
        self.wait = wait


class LeaseLostConflict(IdempotencyHTTPError):
    status_code = 409
    title = "Idempotency lease lost"
    default_code = "idempotency_lease_lost"
    default_message = "Retry with the same key to get the result."
    default_detail = (
        "This request ran past its lease and another request with the same idempotency key "
        "took over; this request's changes were rolled back. Retry with the same key to "
        "receive the other request's result."
    )

    def __init__(self, detail: Any = None) -> None:
        super().__init__(detail)
        self.wait = 1


class PayloadMismatch(IdempotencyHTTPError):
    status_code = 422
    title = "Idempotency key reused"
    default_code = "payload_mismatch"
    default_message = "Send a new request with a new key."
    default_detail = (
        "This idempotency key was already used for a different request (method, path or "
        "body). Use a new key for a new request."
    )


class StoreUnavailable(IdempotencyHTTPError):
    status_code = 503
    title = "Service unavailable"
    default_code = "idempotency_store_unavailable"
    default_message = "Retry with the same key after Retry-After seconds."
    default_detail = (
        "The database that records idempotency keys is unavailable; nothing was done. "
        "Retry with the same key after the number of seconds in Retry-After."
    )

    def __init__(self, wait: int = 1, detail: Any = None) -> None:
        super().__init__(detail)
        self.wait = wait


class StoreNotMigrated(StoreUnavailable):
    """The database has no tables for idempotency keys (or older ones): the app's migrations
    were not applied there. An operator's fix, named in the answer; a retry then succeeds."""

    title = "Idempotency store not migrated"
    default_code = "idempotency_store_not_migrated"
    default_message = "Run `manage.py migrate django_idempotency` on the server."
    default_detail = (
        "The database that records idempotency keys has not been set up; nothing was done. "
        "The server's operator must run `manage.py migrate django_idempotency`; retry with "
        "the same key after that."
    )

    def __init__(self, wait: int = 30, detail: Any = None) -> None:
        super().__init__(wait, detail)


class ResponseNotRetained(IdempotencyHTTPError):
    """A replay of a request whose response body was not stored: same status, this body."""

    title = "Response not retained"
    default_code = "response_not_retained"
    default_message = "Nothing to retry: the request was processed."
    default_detail = (
        "This request was already processed. Its response body was streamed or larger than "
        "MAX_RESPONSE_BYTES, so it was not stored and cannot be replayed."
    )

    def __init__(self, status: int, detail: Any = None) -> None:
        super().__init__(detail)
        self.status_code = status


class CredentialsNotScoped(IdempotencyHTTPError):
    """A key sent with credentials the library cannot tie to a user (``CREDENTIAL_SCOPE``)."""

    status_code = 400
    title = "Idempotency key scope unknown"
    default_code = "idempotency_scope_unknown"
    default_message = "Send the key where the request is authenticated first."
    default_detail = (
        "This request carries credentials that were not authenticated before its idempotency "
        "key was read, so the key cannot be tied to a client. Send it to an endpoint that "
        "authenticates first, or without the key."
    )


class IdempotencyKeyNotFound(IdempotencyHTTPError):
    """A status-by-key lookup found nothing for the caller: the same answer whether the key is
    unknown, expired, released, malformed or another scope's, so it never says which."""

    status_code = 404
    title = "Idempotency key not found"
    default_code = "idempotency_key_not_found"
    default_message = "Retry the request itself with its key."
    default_detail = (
        "There is no idempotency key by this name for you: it was never used with your "
        "credentials, or it expired or was released. Retrying the request itself with the key "
        "is safe."
    )


# --- inbound webhooks (inbox/webhooks) -------------------------------------------------------


class WebhookRejected(IdempotencyHTTPError):
    """An inbound webhook refused before anything was stored: the sender's delivery failed a
    check, so its handler did not run and nothing was marked processed."""

    status_code = 400
    title = "Webhook rejected"
    default_code = "webhook_rejected"
    default_message = "Fix the delivery; the handler did not run."
    default_detail = "The webhook delivery was rejected; nothing was done."


class WebhookSignatureInvalid(WebhookRejected):
    """A missing, malformed or wrong signature (400): every bad signature gets this one answer."""

    title = "Webhook signature invalid"
    default_code = "webhook_signature_invalid"
    default_message = "Sign the delivery with the endpoint's secret."
    default_detail = (
        "The webhook's signature is missing, malformed, or does not match the body with this "
        "endpoint's secret; nothing was done."
    )


class WebhookTimestampStale(WebhookRejected):
    """A signed timestamp further from now than the provider's tolerance (400)."""

    title = "Webhook timestamp stale"
    default_code = "webhook_timestamp_stale"
    default_message = "Send a fresh delivery; check the sender's clock."
    default_detail = (
        "The webhook's signed timestamp is too far from now (a replayed delivery, or a clock "
        "that is off); nothing was done."
    )


class WebhookIdInvalid(WebhookRejected):
    """No event id, or not 1-255 printable ASCII characters without spaces (400)."""

    title = "Webhook event id invalid"
    default_code = "webhook_id_invalid"
    default_message = "Send the event's id as the provider specifies."
    default_detail = (
        "The webhook's event id is missing or malformed (1 to 255 printable ASCII characters, "
        "no spaces); nothing was done."
    )


class WebhookBodyTooLarge(WebhookRejected):
    """A body over the endpoint's ``max_body`` (413); unread when its Content-Length says so."""

    status_code = 413
    title = "Webhook body too large"
    default_code = "webhook_body_too_large"
    default_message = "Send a smaller body, or raise the endpoint's max_body."
    default_detail = "The webhook's body is larger than this endpoint accepts; nothing was done."


# --- @idempotent_function -----------------------------------------------------------------------


class IdempotentFunctionError(IdempotencyError):
    """Base of the errors ``@idempotent_function`` raises about a call."""


class IdempotentCallInProgress(IdempotentFunctionError):
    """Another call with this key is running (its lease has ``retry_after`` seconds left).

    Nothing ran. In a Celery task: ``raise self.retry(exc=exc, countdown=exc.retry_after)``.
    """

    def __init__(self, retry_after: int, message: str | None = None) -> None:
        self.retry_after = retry_after
        super().__init__(
            message
            or f"A call with this idempotency key is still running; call again in "
            f"{retry_after} s to get its result."
        )


class IdempotentCallMismatch(IdempotentFunctionError):
    """The key was already used by a call with different arguments; nothing ran."""


class IdempotentCallKeyInvalid(IdempotentFunctionError, ValueError):
    """The key could not be read from the call's arguments, or is not a usable key."""


class IdempotentResultNotStorable(IdempotentFunctionError):
    """The function's return value could not be serialized (or is larger than
    ``MAX_RESPONSE_BYTES``): its writes were rolled back and the key released."""


# --- Layers 2 and 3: outbox, publishers, consumers --------------------------------------------


class OutboxError(IdempotencyError):
    """Base of the outbox's errors."""


class TransactionRequired(OutboxError):
    """``publish()`` was called outside ``transaction.atomic``.

    Outside a transaction the event would commit on its own, apart from the business writes it
    describes, which is exactly the gap the outbox exists to close.
    """


class UnroutableTopic(OutboxError, IdempotencyConfigurationError):
    """No pattern in ``OUTBOX_PUBLISHERS`` matches the topic."""


class DuplicateEventId(OutboxError):
    """An event with this ``event_id`` already exists; the transaction must roll back."""


class PublishError(OutboxError):
    """A publisher could not hand one event to its broker; the relay retries it later."""


class BrokerUnavailable(PublishError):
    """The broker cannot be reached at all: the relay stops this batch instead of trying each
    remaining event against a dead connection."""


class BrokerConfigurationError(PublishError):
    """The broker (or webhook receiver) answered, and refused the route: wrong credentials, no
    permission for the subject or exchange, a stream, exchange or virtual host that does not
    exist. Retrying soon cannot help and the event is not at fault, so the relay retries it only
    every ``OUTBOX_BACKOFF_MAX_SECONDS`` and never makes it DEAD for this; a person fixes the
    route's ``OPTIONS`` or the broker."""
