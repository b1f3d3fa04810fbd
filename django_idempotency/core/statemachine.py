"""The request state machine: a stored record, a request's fingerprint and the database's time in,
a verdict out.

Every rule about what a retry gets lives here once; when a lease runs and when a record counts as
absent (expired) is ``core/leases.py``'s, in its Python, ORM and SQL forms. The claim
(``request/claims.py``) applies these verdicts under its locks, and the PostgreSQL claim statement
(``db/postgresql.py``) says them in SQL, checked against this module by a property test. Nothing
here knows a request or a database.

Times are the database's: a record's lease is measured by the clock that wrote it, never by the
clock of the web server asking, so servers whose clocks disagree cannot both own one key.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from django_idempotency.core import leases
from django_idempotency.core.statuses import ACCEPTED, COMPLETED, HELD, PROCESSING

__all__ = [
    "ACCEPTED",
    "COMPLETED",
    "HELD",
    "PROCESSING",
    "RecordState",
    "StoredState",
    "Verdict",
    "is_expired",
    "judge",
    "seconds_left",
]


class StoredState(Protocol):
    """What the rules read of a stored record: a :class:`RecordState`, or any row that carries
    these four (the claim's own row, read without building another object per request)."""

    @property
    def status(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def lease_expires_at(self) -> datetime | None: ...
    @property
    def expires_at(self) -> datetime: ...


@dataclass(frozen=True, slots=True)
class RecordState:
    """What the state machine needs of a stored record."""

    status: str
    fingerprint: str
    lease_expires_at: datetime | None
    expires_at: datetime


class Verdict(enum.Enum):
    """What a request may do with its key."""

    #: No live record: claim the key as new (insert, or reuse an expired record).
    CLAIM = "claim"
    #: The same request was PROCESSING and its lease ran out: take the key over.
    TAKE_OVER = "take_over"
    #: The same request is PROCESSING with a running lease, but the connection of the request
    #: holding it is gone (it can never commit): take the key over now, not after the lease.
    TAKE_OVER_DEAD_OWNER = "take_over_dead_owner"
    #: COMPLETED by the same request: answer with the stored response.
    REPLAY = "replay"
    #: The same request was handed to a worker that still holds the key: answer with the
    #: stored 202 (or wait for the worker's final response, like a duplicate in flight).
    HANDED_OFF = "handed_off"
    #: Another request holds a running lease on the key: 409, retry after it.
    CONFLICT = "conflict"
    #: The key was used for a different request: 422.
    MISMATCH = "mismatch"


def is_expired(record: StoredState, now: datetime) -> bool:
    """Past its TTL and not held by a running lease: a claim treats the record as absent
    (``leases.expired``)."""
    return leases.expired(record.status, record.lease_expires_at, record.expires_at, now)


def judge(
    record: StoredState | None, fingerprint: str, now: datetime, *, owner_gone: bool = False
) -> Verdict:
    """The verdict for a request with ``fingerprint`` that finds ``record`` at time ``now``.

    ``owner_gone``: the database says the connection of the request holding the record is gone
    (its session lock is free), so whatever it did can never commit.
    """
    if record is None or is_expired(record, now):
        return Verdict.CLAIM
    if record.fingerprint != fingerprint:
        return Verdict.MISMATCH
    if record.status == COMPLETED:
        return Verdict.REPLAY
    if leases.running(record.status, record.lease_expires_at, now):
        if record.status == ACCEPTED:
            # A worker's lease is never cut short: it holds no session lock to tell by.
            return Verdict.HANDED_OFF
        return Verdict.TAKE_OVER_DEAD_OWNER if owner_gone else Verdict.CONFLICT
    return Verdict.TAKE_OVER


def seconds_left(lease_expires_at: datetime | None, now: datetime) -> int:
    """Whole seconds until a lease runs out, at least 1: the ``Retry-After`` of a 409."""
    if lease_expires_at is None:
        return 1
    return max(1, math.ceil((lease_expires_at - now).total_seconds()))
