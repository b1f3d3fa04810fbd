"""POSTs each event as JSON to a URL, signed, with the event id as its Idempotency-Key.

The receiver deduplicates on ``Idempotency-Key`` and checks the signature with
:func:`verify_signature`: ``Webhook-Signature: t=<unix time>,v1=<hex HMAC-SHA256>`` over
``"<t>.<body>"``, so a captured request cannot be replayed later with a new timestamp.

Webhook URLs carry credentials (a password, a ``?token=``, a secret path segment), and a failed
publish reaches ``OutboxEvent.last_error``, the admin and the logs: errors and httpx itself only
ever see the URL as :func:`redact_url` shows it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    IdempotencyConfigurationError,
    PublishError,
)
from django_idempotency.publishers.base import OutboxMessage, Publisher, to_json

__all__ = [
    "MASK",
    "MAX_SIGNATURE_LENGTH",
    "SECRET_SEGMENT_LENGTH",
    "SIGNATURE_HEADER",
    "WebhookPublisher",
    "redact_url",
    "sign",
    "verify_signature",
]

if TYPE_CHECKING:
    import httpx

SIGNATURE_HEADER = "Webhook-Signature"
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


def sign(secret: str | bytes, timestamp: int, body: bytes) -> str:
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
    """True if ``header`` signs ``body`` with ``secret`` and is at most ``tolerance`` s old.

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
    request headers), ``signature_header`` ("Webhook-Signature"), ``secret_path_segments``
    (positions of path segments to mask in errors, beside those that look secret). Any 2xx
    answer is success; 401, 403 and 407 are a ``BrokerConfigurationError``.

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
        auth = (target.username, target.password) if target.userinfo else None
        self._client = httpx.Client(timeout=timeout, headers=headers or {}, auth=auth)

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

    def close(self) -> None:
        self._client.close()
