"""POSTs each event as JSON to a URL, signed, with the event id as its Idempotency-Key.

The receiver deduplicates on ``Idempotency-Key`` and checks the signature with
:func:`verify_signature`: ``Webhook-Signature: t=<unix time>,v1=<hex HMAC-SHA256>`` over
``"<t>.<body>"``, so a captured request cannot be replayed later with a new timestamp.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

from django_idempotency.exceptions import (
    BrokerUnavailable,
    IdempotencyConfigurationError,
    PublishError,
)
from django_idempotency.publishers.base import OutboxMessage, Publisher, to_json

SIGNATURE_HEADER = "Webhook-Signature"


def sign(secret: str | bytes, timestamp: int, body: bytes) -> str:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def verify_signature(
    secret: str | bytes,
    body: bytes,
    header: str,
    *,
    tolerance: float = 300,
    now: float | None = None,
) -> bool:
    """True if ``header`` signs ``body`` with ``secret`` and is at most ``tolerance`` s old."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), fields.get("v1", ""))


class WebhookPublisher(Publisher):
    """``OPTIONS``: ``url`` and ``secret`` (required), ``timeout`` (10 s), ``headers`` (extra
    request headers), ``signature_header`` ("Webhook-Signature"). Any 2xx answer is success."""

    def __init__(
        self,
        *,
        url: str,
        secret: str | bytes,
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
        signature_header: str = SIGNATURE_HEADER,
    ) -> None:
        super().__init__()
        if not url or not secret:
            raise IdempotencyConfigurationError(
                "WebhookPublisher needs OPTIONS 'url' and a non-empty 'secret' to sign with."
            )
        import httpx

        self.url = url
        self.secret = secret
        self.signature_header = signature_header
        self._client = httpx.Client(timeout=timeout, headers=headers or {})

    def publish(self, message: OutboxMessage) -> None:
        import httpx

        body = to_json(message.envelope())
        timestamp = int(time.time())
        request_headers: dict[str, Any] = {
            "Content-Type": "application/json",
            "Idempotency-Key": str(message.event_id),
            self.signature_header: f"t={timestamp},v1={sign(self.secret, timestamp, body)}",
            **message.trace_headers(),
        }
        try:
            response = self._client.post(self.url, content=body, headers=request_headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise BrokerUnavailable(f"webhook {self.url} unreachable: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise PublishError(f"webhook {self.url} failed: {exc!r}") from exc
        if not response.is_success:
            raise PublishError(f"webhook {self.url} answered {response.status_code}")

    def close(self) -> None:
        self._client.close()
