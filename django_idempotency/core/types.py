"""The values every part of the request layer passes around: what a claim is about, the lease a
request holds, a stored response, and what a claim decided.

They sit below every module that uses them, so the store, the Redis cache, the lifecycle and the
instrumentation share them without importing one another.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_SCOPE_LENGTH",
    "Conflict",
    "Decision",
    "Identity",
    "Lease",
    "Mismatch",
    "Proceed",
    "Replay",
    "StoredResponse",
]

#: The longest key a client may send (characters); the record's key column holds this many.
MAX_KEY_LENGTH = 255
#: The record's scope column holds this many characters; longer scopes are hashed to fit.
MAX_SCOPE_LENGTH = 255


@dataclass(frozen=True, slots=True)
class Identity:
    """What a claim is about: the key in its scope, and the request it must keep meaning."""

    scope: str
    key: str
    fingerprint: str
    method: str
    path: str


@dataclass(frozen=True, slots=True)
class Lease:
    """A successful claim: this request owns the key until ``expires_at`` (database time).

    Views reach it as ``request.idempotency``.
    """

    identity: Identity
    owner_token: uuid.UUID
    expires_at: datetime
    attempt: int
    using: str
    #: Whether this request holds its session lock, which tells duplicates it is alive.
    owner_lock: bool = False
    #: This key's lease length and its record's time to live once completed (seconds), when
    #: its door chose them (``@idempotent_function(lease=..., ttl=...)``); None: the settings'
    #: ``LEASE_SECONDS`` and ``TTL_SECONDS``.
    lease_seconds: float | None = None
    ttl_seconds: float | None = None

    @property
    def taken_over(self) -> bool:
        """Whether an earlier request held this key and died or overran its lease."""
        return self.attempt > 1

    def derived_key(self, suffix: str) -> str:
        """A stable key for a downstream call (a vendor's own Idempotency-Key header).

        Every attempt of this request, including a takeover after a crash, derives the same key,
        so the vendor deduplicates what our transaction cannot roll back.
        """
        return f"{self.identity.scope}:{self.identity.key}:{suffix}"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """What a replay needs: status, allowed headers and the exact body bytes."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    retained: bool = True


@dataclass(frozen=True, slots=True)
class Proceed:
    """The request owns the key: run the view."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class Replay:
    """The key completed for this same request: answer with its stored response."""

    response: StoredResponse
    #: The stored response is the 202 of a request handed to a worker that still holds the
    #: key (ACCEPTED): a duplicate that may wait waits for the worker's final response.
    handed_off: bool = False
    #: Seconds the record has left before it expires, when the answer's source knows: how long
    #: this process may keep the answer in memory (``LOCAL_REPLAY_SECONDS``).
    expires_in: float | None = None


@dataclass(frozen=True, slots=True)
class Conflict:
    """Another request holds the key: 409, retry after ``retry_after`` seconds."""

    retry_after: int


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key was used for a different request: 422."""


Decision = Proceed | Replay | Conflict | Mismatch
