"""What makes two failures "the same": the fingerprint the admin groups failed events by.

A fingerprint is the hash of a failure's *signature*: the exception's type and message, with
what differs from one event to the next (ids, numbers, timestamps) normalised away, so that
``PublishError: webhook answered 503 for order 1041`` and ``... for order 1042`` are one group.
The relay computes it once, when it records a failure, and stores it in an indexed column:
grouping a million events then reads an index, never a regular expression over their text.

Everything here is pure (no database, no settings), so the relay, the idempotent consumers
(whose failed messages are grouped the same way), the migration that fingerprints failures
recorded before fingerprints existed, and the tests share one definition.
The signature is computed from the same text the relay stores in ``last_error``, so a
fingerprint can be recomputed from a stored error: the two always agree.

A publish failure also has a *kind* (:class:`FailureKind`), one of a fixed few: what the relay's
retries, the admin's filter, the health panel and the metrics' ``reason`` label go by.
"""

from __future__ import annotations

import hashlib
import re
import traceback
from types import TracebackType

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    IdempotencyConfigurationError,
)

__all__ = [
    "FINGERPRINT_LENGTH",
    "FailureKind",
    "MESSAGE_MAX_CHARS",
    "TRACEBACK_MAX_CHARS",
    "TRACEBACK_MAX_FRAMES",
    "describe",
    "failure_fingerprint",
    "failure_kind",
    "failure_traceback",
    "fingerprint_of",
    "normalise",
]

#: Hex digits kept of the signature's SHA-256: 128 bits, collision-free for any real outbox.
FINGERPRINT_LENGTH = 32
#: ``last_error`` (and so the signature) keeps this many characters of ``Type: message``.
MESSAGE_MAX_CHARS = 2000
#: A stored traceback keeps its last this many characters: the innermost frames and the
#: exception line, where the cause is.
TRACEBACK_MAX_CHARS = 8000
#: Frames kept per exception in the chain, the innermost ones.
TRACEBACK_MAX_FRAMES = 30

# Order matters: a UUID or a timestamp is replaced whole before its digits could be.
_NORMALISERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"\b[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\b", re.IGNORECASE
        ),
        "<uuid>",
    ),
    (
        # ISO 8601 and the like: 2026-11-24, 2026-11-24T02:05:07.123+00:00, 2026-11-24 02:05Z.
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?"
            r"(?:\s?(?:Z|UTC|[+-]\d{2}(?::?\d{2})?))?)?\b"
        ),
        "<time>",
    ),
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"), "<time>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.IGNORECASE), "<hex>"),
    # Hex digests and ids: 8 or more hex digits mixing letters and digits (so words such as
    # "deadbeef" or "accepted" and plain numbers are left to the other rules).
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b", re.IGNORECASE), "<hex>"),
    # Generated ids (ch_3MmlLrLkdIwHu7ix0snN0B15, tok9f8e...): 12 or more word characters
    # mixing letters and digits.
    (re.compile(r"\b(?=\w*\d)(?=\w*[a-z])\w{12,}\b", re.IGNORECASE), "<id>"),
    (re.compile(r"\d+"), "<n>"),
    (re.compile(r"\s+"), " "),
)


class FailureKind(models.TextChoices):
    """Why publishing failed, as an operator acts on it."""

    #: The broker could not be reached (down, a network fault): it comes back on its own.
    UNREACHABLE = "unreachable", _("Unreachable")
    #: The broker refused the route (credentials, permissions, a missing stream or exchange),
    #: or the route itself is wrong (no route, bad OPTIONS): a person must fix it.
    CONFIGURATION = "configuration", _("Configuration")
    #: Anything else: the broker refused this message, a timeout, an error of the publisher.
    OTHER = "other", _("Other")


def failure_kind(error: BaseException) -> FailureKind:
    """The kind of a publish failure (see :class:`FailureKind`)."""
    if isinstance(error, BrokerConfigurationError | IdempotencyConfigurationError):
        return FailureKind.CONFIGURATION
    if isinstance(error, BrokerUnavailable):
        return FailureKind.UNREACHABLE
    return FailureKind.OTHER


def describe(error: BaseException) -> str:
    """``Type: message``, cut to ``MESSAGE_MAX_CHARS``: what ``last_error`` stores."""
    return f"{type(error).__name__}: {error}"[:MESSAGE_MAX_CHARS]


def normalise(text: str) -> str:
    """``text`` with ids, numbers and timestamps replaced by placeholders (``<uuid>``,
    ``<time>``, ``<hex>``, ``<id>``, ``<n>``) and runs of white space made one space."""
    for pattern, placeholder in _NORMALISERS:
        text = pattern.sub(placeholder, text)
    return text.strip()


def fingerprint_of(error_text: str) -> str:
    """The fingerprint of a stored ``last_error`` (``Type: message``)."""
    signature = normalise(error_text)
    return hashlib.sha256(signature.encode()).hexdigest()[:FINGERPRINT_LENGTH]


def failure_fingerprint(error: BaseException) -> str:
    """The group a failure belongs to: equal for failures that differ only in ids, numbers
    and timestamps."""
    return fingerprint_of(describe(error))


def failure_traceback(error: BaseException) -> str:
    """The traceback of ``error`` and of the exceptions it was raised from, as Python prints
    it; empty when none of them was ever raised (a publisher may return an error unraised).

    Only ``error``'s own message is kept (it is ``last_error``'s). The exceptions it was
    raised from show their type alone: their text comes from libraries (an HTTP client, a
    broker driver) and may quote what a publisher keeps out of its own errors, such as a
    URL's credentials. Local variables are never kept. At most ``TRACEBACK_MAX_FRAMES``
    frames per exception and the last ``TRACEBACK_MAX_CHARS`` characters are stored.
    """
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    current: BaseException | None = error
    link = ""
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _CONTEXT
        else:
            current = None
    if all(exc.__traceback__ is None for exc, _link in chain):
        return ""
    parts: list[str] = []
    # Python prints the innermost exception first and the one that was finally raised last.
    for position, (exc, _link) in enumerate(reversed(chain)):
        if position:
            parts.append(chain[len(chain) - position][1])
        parts.append(_format_one(exc, exc is error))
    text = "".join(parts)
    if len(text) > TRACEBACK_MAX_CHARS:
        cut = len(text) - TRACEBACK_MAX_CHARS
        text = f"… ({cut} characters cut)\n" + text[cut:]
    return text


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _format_one(exc: BaseException, with_message: bool) -> str:
    frames = _frames(exc.__traceback__)
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    line = f"{name}: {exc}"[:MESSAGE_MAX_CHARS] if with_message else f"{name} (message not stored)"
    header = "Traceback (most recent call last):\n" if frames else ""
    return f"{header}{frames}{line}\n"


def _frames(tb: TracebackType | None) -> str:
    if tb is None:
        return ""
    return "".join(traceback.format_tb(tb, limit=-TRACEBACK_MAX_FRAMES))
