"""Who sent a webhook, checked: each provider verifies its sender's signature, then reads the
sender's event id (and type), or refuses the delivery with a ``WebhookRejected``.

A provider never stores anything and never runs the handler: :func:`idempotent_webhook` calls
:meth:`Provider.receive` first, and only a delivery it returns goes on to the inbox. Every bad
signature gets the same answer, whatever was wrong with it. Stripe's signature is checked before
its timestamp, so only a genuine (but late) delivery hears that its timestamp is stale; the
``standardwebhooks`` library checks the timestamp first.
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest

from django_idempotency.exceptions import (
    IdempotencyConfigurationError,
    WebhookIdInvalid,
    WebhookRejected,
    WebhookSignatureInvalid,
    WebhookTimestampStale,
)

__all__ = [
    "CustomProvider",
    "Delivery",
    "GitHub",
    "Provider",
    "Secret",
    "StandardWebhooks",
    "Stripe",
    "valid_event_id",
]

logger = logging.getLogger(__name__)

#: One secret, several (any one verifies: rotation), or a callable returning either, read on
#: every delivery (``lambda: settings.STRIPE_WEBHOOK_SECRET``), so nothing is bound at import.
Secret = str | bytes | Sequence[str | bytes] | Callable[[], str | bytes | Sequence[str | bytes]]

#: What an event id may be: what ``ProcessedMessage.message_id`` holds, and nothing a log line
#: or the admin could be fooled by (no spaces, no control characters).
_EVENT_ID = re.compile(r"[!-~]{1,255}")
#: Longer signature headers are refused unread.
_MAX_HEADER = 4096
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DIGITS = re.compile(r"[0-9]{1,15}")


def valid_event_id(value: object) -> str:
    """``value`` when it is an event id the inbox can hold, else :class:`WebhookIdInvalid`."""
    if not isinstance(value, str) or not _EVENT_ID.fullmatch(value):
        raise WebhookIdInvalid()
    return value


@dataclass(frozen=True, slots=True)
class Delivery:
    """A verified delivery: the sender's event id, its type when the sender says, and the body
    parsed as JSON (None when it is not JSON)."""

    id: str
    type: str | None
    payload: Any


def parse_json(body: bytes) -> Any:
    """The body as JSON, or None when it is not."""
    try:
        return json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        return None


def _field(payload: Any, name: str) -> str | None:
    value = payload.get(name) if isinstance(payload, dict) else None
    return value if isinstance(value, str) else None


class Provider(abc.ABC):
    """A webhook sender's scheme: how its deliveries are signed and where their ids are."""

    #: Names the provider in logs, in the event handed to the handler, and in the default
    #: consumer name.
    name: str

    @abc.abstractmethod
    def receive(self, request: HttpRequest, body: bytes) -> Delivery:
        """Verify ``body`` as ``request`` delivered it, then read its event id; raise a
        :class:`~django_idempotency.exceptions.WebhookRejected` to refuse it."""


class _Signed(Provider):
    """A provider verifying with one or more shared secrets."""

    def __init__(self, secret: Secret) -> None:
        self._secret = secret
        if not callable(secret):
            self._keys(secret)  # refuse an empty secret at once, not at the first delivery

    def keys(self) -> list[bytes]:
        """The keys a delivery may be signed with now."""
        source = self._secret() if callable(self._secret) else self._secret
        return self._keys(source)

    def _keys(self, source: str | bytes | Sequence[str | bytes]) -> list[bytes]:
        secrets = [source] if isinstance(source, str | bytes) else list(source)
        keys = [self.key(secret) for secret in secrets if secret]
        if not keys:
            raise IdempotencyConfigurationError(
                f"idempotent_webhook({type(self).__name__}(secret=...)): the secret is empty. "
                "Pass the signing secret the provider shows for this endpoint (or a callable "
                "that reads it from the settings)."
            )
        return keys

    def key(self, secret: str | bytes) -> bytes:
        """The HMAC key a secret stands for: its UTF-8 bytes, as Stripe and GitHub use it."""
        return secret.encode() if isinstance(secret, str) else secret


def _header(request: HttpRequest, name: str) -> str:
    value = request.headers.get(name)
    if value is None or len(value) > _MAX_HEADER:
        raise WebhookSignatureInvalid()
    return value


def _fresh(timestamp: int, tolerance: float) -> None:
    if abs(time.time() - timestamp) > tolerance:
        raise WebhookTimestampStale()


class StandardWebhooks(_Signed):
    """`Standard Webhooks <https://www.standardwebhooks.com>`_ (Svix, Clerk, Resend, …, and this
    app's own webhook publisher), verified by the ``standardwebhooks`` library (the
    ``inbound-webhooks`` extra). The id is ``webhook-id``; the type, the body's ``type``.

    ``secret``: the ``whsec_…`` secret the sender shows (see :data:`Secret`). The timestamp may
    be at most ``tolerance`` seconds from now, never more than the library's five minutes.
    """

    name = "standard-webhooks"

    def __init__(self, secret: Secret, *, tolerance: float = 300) -> None:
        if not 0 < tolerance <= 300:
            raise IdempotencyConfigurationError(
                "StandardWebhooks(tolerance=...) must be more than 0 and at most 300 seconds: "
                "the standardwebhooks library refuses timestamps older than five minutes."
            )
        self.tolerance = tolerance
        super().__init__(secret)

    def key(self, secret: str | bytes) -> bytes:
        from django_idempotency.publishers.webhook import standard_key

        return standard_key(secret)

    def receive(self, request: HttpRequest, body: bytes) -> Delivery:
        from standardwebhooks import Webhook, WebhookVerificationError

        headers = {
            name: _header(request, name)
            for name in ("webhook-id", "webhook-timestamp", "webhook-signature")
        }
        if not _DIGITS.fullmatch(headers["webhook-timestamp"]):
            raise WebhookSignatureInvalid()
        for key in self.keys():
            try:
                Webhook(key).verify(body, headers, json_parse=False)
            except WebhookVerificationError as exc:
                # The library checks the timestamp first, against its own five minutes.
                if str(exc).startswith("Message timestamp"):
                    raise WebhookTimestampStale() from exc
                continue
            except ValueError:  # the library's parse of a malformed signature or body
                continue
            _fresh(int(headers["webhook-timestamp"]), self.tolerance)
            payload = parse_json(body)
            return Delivery(valid_event_id(headers["webhook-id"]), _field(payload, "type"), payload)
        raise WebhookSignatureInvalid()


class Stripe(_Signed):
    """Stripe's ``Stripe-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<body>">`` (any
    ``v1`` may match: Stripe sends one per secret while a secret is rolled), checked as Stripe's
    own library does, without needing it. The id is the event's ``id`` in the body; the type,
    its ``type``.

    ``secret``: the endpoint's ``whsec_…`` signing secret, used as Stripe uses it (its bytes).
    """

    name = "stripe"

    def __init__(self, secret: Secret, *, tolerance: float = 300) -> None:
        self.tolerance = tolerance
        super().__init__(secret)

    def receive(self, request: HttpRequest, body: bytes) -> Delivery:
        header = _header(request, "Stripe-Signature")
        timestamps: list[str] = []
        signatures: list[str] = []
        for part in header.split(","):
            name, equals, value = part.partition("=")
            if not equals:
                raise WebhookSignatureInvalid()
            if name == "t":
                timestamps.append(value)
            elif name == "v1" and _HEX64.fullmatch(value):
                signatures.append(value)
        if len(timestamps) != 1 or not _DIGITS.fullmatch(timestamps[0]) or not signatures:
            raise WebhookSignatureInvalid()
        signed = timestamps[0].encode() + b"." + body
        expected = [hmac.new(key, signed, hashlib.sha256).hexdigest() for key in self.keys()]
        if not any(hmac.compare_digest(e, s) for e in expected for s in signatures):
            raise WebhookSignatureInvalid()
        _fresh(int(timestamps[0]), self.tolerance)
        payload = parse_json(body)
        return Delivery(valid_event_id(_field(payload, "id")), _field(payload, "type"), payload)


class GitHub(_Signed):
    """GitHub's ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>``. The id is
    ``X-GitHub-Delivery`` (the same on a redelivery); the type, ``X-GitHub-Event``.

    GitHub signs no timestamp and not the delivery id: a delivery captured in transit could be
    sent again under a new id. Serve the endpoint over HTTPS only.
    """

    name = "github"

    def receive(self, request: HttpRequest, body: bytes) -> Delivery:
        header = _header(request, "X-Hub-Signature-256")
        scheme, _, signature = header.partition("=")
        if scheme != "sha256" or not _HEX64.fullmatch(signature):
            raise WebhookSignatureInvalid()
        expected = [hmac.new(key, body, hashlib.sha256).hexdigest() for key in self.keys()]
        if not any(hmac.compare_digest(e, signature) for e in expected):
            raise WebhookSignatureInvalid()
        event_id = valid_event_id(request.headers.get("X-GitHub-Delivery"))
        return Delivery(event_id, request.headers.get("X-GitHub-Event"), parse_json(body))


class CustomProvider(Provider):
    """Any other sender: ``verify(request, body)`` says whether the signature holds (falsy, or
    an exception, refuses the delivery 400 ``webhook_signature_invalid``; raise a
    ``WebhookRejected`` of your own for another answer); ``event_id(request, body)`` reads the
    sender's event id, and ``event_type`` its type (optional).
    """

    def __init__(
        self,
        *,
        verify: Callable[[HttpRequest, bytes], object],
        event_id: Callable[[HttpRequest, bytes], str],
        event_type: Callable[[HttpRequest, bytes], str | None] | None = None,
        name: str = "custom",
    ) -> None:
        self.verify = verify
        self.event_id = event_id
        self.event_type = event_type
        self.name = name

    def receive(self, request: HttpRequest, body: bytes) -> Delivery:
        try:
            verified = self.verify(request, body)
        except WebhookRejected:
            raise
        except Exception as exc:
            logger.warning(
                "webhook verifier raised; the delivery is refused",
                exc_info=True,
                extra={"provider": self.name},
            )
            raise WebhookSignatureInvalid() from exc
        if not verified:
            raise WebhookSignatureInvalid()
        try:
            event_id = self.event_id(request, body)
        except WebhookRejected:
            raise
        except Exception as exc:
            raise WebhookIdInvalid() from exc
        event_type = self.event_type(request, body) if self.event_type is not None else None
        return Delivery(valid_event_id(event_id), event_type, parse_json(body))
