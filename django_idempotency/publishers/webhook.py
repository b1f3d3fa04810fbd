"""POSTs each event as JSON to a URL, signed, with the event id as its Idempotency-Key.

By default the request speaks `Standard Webhooks <https://www.standardwebhooks.com>`_, signed by
the ``standardwebhooks`` library: ``webhook-id`` (the event id), ``webhook-timestamp`` and
``webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``, so any Standard
Webhooks library verifies it and deduplicates on ``webhook-id``. The secret is a Standard
Webhooks secret, ``whsec_`` followed by the base64 of the key (:func:`new_secret`).

``signature_scheme="legacy"`` keeps the app's former scheme for receivers built on
:func:`verify_signature`: ``Webhook-Signature: t=<unix time>,v1=<hex HMAC-SHA256>`` over
``"<t>.<body>"`` with the secret's bytes. Either way a captured request cannot be replayed later
with a new timestamp, and ``Idempotency-Key`` carries the event id too.

Webhook URLs carry credentials (a password, a ``?token=``, a secret path segment), and a failed
publish reaches ``OutboxEvent.last_error``, the admin and the logs: errors and httpx itself only
ever see the URL as :func:`redact_url` shows it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Collection
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import unquote

from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    IdempotencyConfigurationError,
    PublishError,
)
from django_idempotency.publishers.base import OutboxMessage, Publisher, to_json

__all__ = [
    "LEGACY",
    "MASK",
    "MAX_SIGNATURE_LENGTH",
    "SECRET_PREFIX",
    "SECRET_SEGMENT_LENGTH",
    "SIGNATURE_HEADER",
    "STANDARD",
    "SignatureScheme",
    "WebhookPublisher",
    "new_secret",
    "redact_url",
    "sign",
    "standard_key",
    "verify_signature",
]

if TYPE_CHECKING:
    import httpx
    from standardwebhooks import Webhook

#: The legacy scheme's header (``signature_scheme="legacy"``).
SIGNATURE_HEADER = "Webhook-Signature"
SignatureScheme = Literal["standard", "legacy"]
#: Standard Webhooks: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature`` (the default).
STANDARD: Final[SignatureScheme] = "standard"
#: The app's former ``Webhook-Signature: t=…,v1=…`` scheme, for receivers that verify it.
LEGACY: Final[SignatureScheme] = "legacy"
#: What a Standard Webhooks secret starts with; the base64 of the key follows.
SECRET_PREFIX = "whsec_"
MASK = "***"
#: A path segment this long is masked unless it reads as plain words (:func:`redact_url`).
SECRET_SEGMENT_LENGTH = 16
#: Answers that refuse the route, not the event: a configuration error (not authenticated, not
#: authorised, not authenticated to a proxy).
_REFUSED = frozenset({401, 403, 407})
_PLAIN_WORDS = re.compile(r"[a-z]{1,15}(?:[-_.][a-z]{1,15})*")
#: Longer signature headers are refused unread; the ones :func:`sign` makes have about 80.
MAX_SIGNATURE_LENGTH = 256
#: The parts of a signature header and what each must be: ASCII digits, lowercase hex.
_SIGNATURE_PARTS = {"t": re.compile(r"[0-9]{1,15}"), "v1": re.compile(r"[0-9a-f]{64}")}


def new_secret(size: int = 32) -> str:
    """A new Standard Webhooks secret: ``whsec_`` and the base64 of ``size`` random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(size)).decode("ascii")


def standard_key(secret: str | bytes) -> bytes:
    """The key a Standard Webhooks secret stands for: the base64 after ``whsec_`` decoded, or
    ``secret`` itself when it is bytes already.

    Anything else is refused rather than guessed at: the ``standardwebhooks`` library would read
    another string as base64 too, and sender and receiver must agree on the key's bytes. The
    message never quotes the secret.
    """
    if isinstance(secret, bytes):
        key = secret
    elif secret.startswith(SECRET_PREFIX):
        try:
            key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
        except (binascii.Error, ValueError):
            key = b""
    else:
        key = b""
    if not key:
        raise IdempotencyConfigurationError(
            "A Standard Webhooks secret is 'whsec_' followed by the base64 of the key, or the "
            "key's bytes; generate one with "
            "django_idempotency.publishers.webhook.new_secret(). A receiver that verifies the "
            "legacy 'Webhook-Signature: t=...,v1=...' scheme needs the publisher's OPTIONS "
            "'signature_scheme': 'legacy' instead."
        )
    return key


def sign(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """The legacy scheme's hex HMAC-SHA256 of ``"<timestamp>.<body>"`` with the secret's bytes."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def verify_signature(
    secret: str | bytes,
    body: bytes,
    header: str | None,
    *,
    tolerance: float = 300,
    now: float | None = None,
) -> bool:
    """True if ``header`` signs ``body`` with ``secret`` and is at most ``tolerance`` s old: the
    legacy scheme's check (Standard Webhooks receivers use the ``standardwebhooks`` library).

    Every other header is False, never an exception, so a receiver answers all bad signatures
    alike: a missing one (None), one longer than ``MAX_SIGNATURE_LENGTH``, one with a character
    outside its ASCII alphabet (a WSGI server decodes header bytes as latin-1), and one that is
    not exactly one ``t=<digits>`` and one ``v1=<64 hex digits>``, comma-separated.
    """
    if not isinstance(header, str) or len(header) > MAX_SIGNATURE_LENGTH:
        return False
    fields: dict[str, str] = {}
    for part in header.split(","):
        name, equals, value = part.partition("=")
        pattern = _SIGNATURE_PARTS.get(name)
        if not equals or pattern is None or name in fields or not pattern.fullmatch(value):
            return False
        fields[name] = value
    if fields.keys() != _SIGNATURE_PARTS.keys():
        return False
    timestamp = int(fields["t"])
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), fields["v1"])


def redact_url(url: str, *, secret_segments: Collection[int] = ()) -> str:
    """``url`` as errors and logs show it: scheme, host, port and path, without credentials.

    The userinfo and fragment are dropped, every query value is masked, and a path segment is
    masked when it looks like a secret (16 or more characters that are not plain lowercase
    words) or its position is in ``secret_segments`` (0 is the first segment, -1 the last).
    """
    import httpx

    try:
        return str(_shown_url(httpx.URL(url), secret_segments))
    except httpx.InvalidURL:
        return "(invalid URL)"


def _shown_url(url: httpx.URL, secret_segments: Collection[int]) -> httpx.URL:
    path, _, query = url.raw_path.decode("ascii").partition("?")
    return url.copy_with(
        username=None,
        password=None,
        fragment=None,
        raw_path=(_redact_path(path, secret_segments) + _redact_query(query)).encode("ascii"),
    )


def _redact_path(path: str, secret_segments: Collection[int]) -> str:
    segments = path.split("/")
    # An absolute path starts with "/": segments[0] is then empty and positions skip it.
    first = 1 if path.startswith("/") else 0
    count = len(segments) - first
    secret = {
        position % count + first for position in secret_segments if -count <= position < count
    }
    return "/".join(
        MASK if index in secret or _looks_secret(segment) else segment
        for index, segment in enumerate(segments)
    )


def _redact_query(query: str) -> str:
    if not query:
        return ""
    masked = []
    for item in query.split("&"):
        name, equals, _ = item.partition("=")
        masked.append(f"{name}={MASK}" if equals and not _looks_secret(name) else MASK)
    return "?" + "&".join(masked)


def _looks_secret(text: str) -> bool:
    decoded = unquote(text)
    return len(decoded) >= SECRET_SEGMENT_LENGTH and not _PLAIN_WORDS.fullmatch(decoded)


def _os_reason(exc: BaseException) -> str:
    """The operating system's words for a failed connection ("Connection refused"), if any.

    httpx's own messages may quote the request; the OS error under them never holds a URL.
    """
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        if isinstance(current, OSError) and current.strerror:
            return f" ({current.strerror})"
        chain.append(current)
        current = current.__cause__ or current.__context__
    return ""


class WebhookPublisher(Publisher):
    """``OPTIONS``: ``url`` and ``secret`` (required), ``timeout`` (10 s), ``headers`` (extra
    request headers), ``signature_scheme`` (``"standard"``, Standard Webhooks, or
    ``"legacy"``), ``signature_header`` (the legacy scheme's header, "Webhook-Signature"),
    ``secret_path_segments`` (positions of path segments to mask in errors, beside those that
    look secret). Any 2xx answer is success; 401, 403 and 407 are a ``BrokerConfigurationError``.

    With ``"standard"`` the secret is a Standard Webhooks secret (``whsec_`` and base64, see
    :func:`new_secret`) or the key's bytes; with ``"legacy"`` any non-empty string or bytes.

    The client is given the redacted URL, so nothing httpx logs or raises can hold a credential:
    the userinfo goes as Basic auth and the real path and query as the request's ``target``.
    """

    def __init__(
        self,
        *,
        url: str,
        secret: str | bytes,
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
        signature_header: str = SIGNATURE_HEADER,
        secret_path_segments: Collection[int] = (),
        signature_scheme: SignatureScheme = STANDARD,
    ) -> None:
        super().__init__()
        if not url or not secret:
            raise IdempotencyConfigurationError(
                "WebhookPublisher needs OPTIONS 'url' and a non-empty 'secret' to sign with."
            )
        import httpx

        try:
            target = httpx.URL(url)
        except httpx.InvalidURL:
            target = None
        if target is None or target.scheme not in ("http", "https") or not target.host:
            # The message never quotes the URL: it may hold a password or a token.
            raise IdempotencyConfigurationError(
                "WebhookPublisher OPTIONS 'url' must be an absolute http:// or https:// URL."
            )
        self.url = url
        #: What errors and logs show of ``url``.
        self.shown_url = _shown_url(target, secret_path_segments)
        self._target = target.copy_with(fragment=None).raw_path
        self.secret = secret
        self.signature_header = signature_header
        self.signature_scheme = signature_scheme
        self._standard: Webhook | None = None
        if signature_scheme == STANDARD:
            from standardwebhooks import Webhook

            self._standard = Webhook(standard_key(secret))
        elif signature_scheme != LEGACY:
            raise IdempotencyConfigurationError(
                f"WebhookPublisher OPTIONS 'signature_scheme' must be {STANDARD!r} (Standard "
                f"Webhooks) or {LEGACY!r}, not {signature_scheme!r}."
            )
        auth = (target.username, target.password) if target.userinfo else None
        self._client = httpx.Client(timeout=timeout, headers=headers or {}, auth=auth)

    def publish(self, message: OutboxMessage) -> None:
        import httpx

        body = to_json(message.envelope())
        request_headers: dict[str, Any] = {
            "Content-Type": "application/json",
            "Idempotency-Key": str(message.event_id),
            **self.signature_headers(str(message.event_id), body),
            **message.trace_headers(),
        }
        # Messages are built from the exception's type, never from its text.
        try:
            response = self._client.post(
                self.shown_url,
                content=body,
                headers=request_headers,
                extensions={"target": self._target},
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            reason = f"{type(exc).__name__}{_os_reason(exc)}"
            raise BrokerUnavailable(f"webhook {self.shown_url} unreachable: {reason}") from exc
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}{_os_reason(exc)}"
            raise PublishError(f"webhook {self.shown_url} failed: {reason}") from exc
        if response.status_code in _REFUSED:
            raise BrokerConfigurationError(
                f"webhook {self.shown_url} answered {response.status_code}: the receiver "
                "refused the route's credentials or signature; check its url and secret"
            )
        if not response.is_success:
            raise PublishError(f"webhook {self.shown_url} answered {response.status_code}")

    def signature_headers(self, event_id: str, body: bytes) -> dict[str, str]:
        """The headers that sign ``body`` as the event ``event_id``, now."""
        timestamp = int(time.time())
        if self._standard is None:
            return {self.signature_header: f"t={timestamp},v1={sign(self.secret, timestamp, body)}"}
        at = datetime.fromtimestamp(timestamp, tz=UTC)
        return {
            "webhook-id": event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": self._standard.sign(event_id, at, body.decode("utf-8")),
        }

    def close(self) -> None:
        self._client.close()
