"""The run step: one run of a door's work under a claimed key, and what it leaves stored.

Every door runs its work through :func:`run_step` once its claim won a lease: views (through
``lifecycle.run``), ``@idempotent_function`` and the workers of handed-off requests. The work
runs inside one transaction per database (the records' database first); its answer is stored in
that same transaction, fenced by the owner token, or nothing is stored and the key is released
(:func:`release`). Written once here so that every door keeps the same rules: what a run stores
commits with its writes or not at all, and caches learn of it only once it committed.

Below this module sit the record store (``store.py``), the answers kept in memory
(``memory.py``), the waiters (``attach.py``) and the heartbeat; the lifecycle and the doors sit
above it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from django.db import connections, transaction

from django_idempotency.conf import conf
from django_idempotency.core.statemachine import ACCEPTED, COMPLETED, PROCESSING
from django_idempotency.core.types import Lease, StoredResponse
from django_idempotency.exceptions import LeaseLost
from django_idempotency.request import attach, instrumentation, memory, store
from django_idempotency.request.heartbeat import LeaseHeartbeat

__all__ = [
    "HANDED_OFF",
    "Ended",
    "HandOff",
    "Keep",
    "Ran",
    "release",
    "run_step",
]

#: The attribute ``handoff.hand_off`` sets on its 202 response (a :class:`HandOff`).
HANDED_OFF = "_idempotency_hand_off"


@dataclass(frozen=True, slots=True)
class HandOff:
    """A 202 that hands the key to a worker, which then holds it for ``hold_seconds``."""

    hold_seconds: float


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Keep:
    """What a run stores under its key, in the transaction of its writes."""

    stored: StoredResponse
    #: A hand-off's 202: the key goes to a worker for this many seconds (ACCEPTED), not done.
    hold_seconds: float | None = None


class Ended(enum.Enum):
    """How one run of a door's work ended."""

    #: Its answer is stored (COMPLETED); retries replay it.
    COMPLETED = "completed"
    #: Its 202 is stored and the key held by the worker it handed its work to (ACCEPTED).
    HANDED_OFF = "handed_off"
    #: It marked its transaction for rollback (``set_rollback``, a database error it caught):
    #: nothing of it committed, nothing is stored, the key is released.
    ROLLED_BACK = "rolled_back"
    #: Its answer is not final (``should_store``): rolled back and released as well.
    NOT_STORED = "not_stored"
    #: A handed-off worker found its work completed by an earlier delivery: nothing ran.
    ALREADY_COMPLETED = "already_completed"
    #: A handed-off worker found the key no longer its own (its hold ran out and a retry took
    #: it over, or an operator released it): nothing ran; the new owner does the work.
    NOT_OURS = "not_ours"


@dataclass(frozen=True, slots=True)
class Ran(Generic[T]):
    """What a run step did: how it ended, what the work returned (None when it never ran), and
    what was stored."""

    ended: Ended
    value: T | None
    kept: Keep | None = None


class _NotStored(Exception):
    """Leaves the transactions (rolling them back) with a value that is not stored."""

    def __init__(self, value: Any, ended: Ended) -> None:
        self.value = value
        self.ended = ended


def run_step(
    lease: Lease,
    work: Callable[[], T],
    keep: Callable[[T], Keep | None],
    *,
    also: Collection[str] = (),
    heartbeat: bool | None = None,
    handed_off: bool = False,
) -> Ran[T]:
    """Run a door's work once under ``lease``, and store what ``keep`` makes of its result in the
    same transaction, fenced by the owner token; release the key when nothing is stored.

    Every door runs through here: views (:func:`run`), ``@idempotent_function`` and the workers
    of handed-off requests (``handed_off``: the work first takes up the ACCEPTED key, and if it
    raises the key stays held for the task's own retry). ``also`` names the other databases
    whose transactions commit with the record (opened after it, so they commit first and a
    stored answer never claims writes that failed to commit).

    What was stored reaches this process's memory and the waiters only from ``on_commit`` of
    the outermost transaction: inside a caller's transaction that later rolls back, nothing of
    this run is remembered anywhere. Raises :class:`LeaseLost` when the key was taken over
    meanwhile (the work's writes rolled back), and whatever the work raised, after releasing
    the key.
    """
    aliases = [lease.using, *(alias for alias in also if alias != lease.using)]
    held_as = ACCEPTED if handed_off else PROCESSING
    connection = connections[lease.using]
    beat = conf.LEASE_HEARTBEAT if heartbeat is None else heartbeat
    if handed_off or connection.vendor == "sqlite" or connection.in_atomic_block:
        # SQLite has one writer at a time: nobody can take the key over meanwhile, and a
        # heartbeat could not write either. Inside a caller's transaction the claim is not
        # committed: a heartbeat's own connection would wait on the row lock this thread holds.
        # A worker's hold is its lease, never extended.
        beat = False
    try:
        with LeaseHeartbeat(lease) if beat else nullcontext(), ExitStack() as transactions:
            for alias in aliases:
                transactions.enter_context(transaction.atomic(using=alias))
            if handed_off and not store.resume(lease):
                return _skipped(lease)
            value = work()
            if connection.needs_rollback or any(
                connections[alias].needs_rollback for alias in aliases[1:]
            ):
                if getattr(value, HANDED_OFF, None) is not None:
                    # Its 202 would promise work that the rollback took back out of the outbox.
                    raise RuntimeError(
                        "The view handed its work off, then marked its transaction for "
                        "rollback: nothing was enqueued, so its 202 cannot be answered."
                    )
                raise _NotStored(value, Ended.ROLLED_BACK)
            kept = keep(value)
            if kept is None:
                raise _NotStored(value, Ended.NOT_STORED)
            if kept.hold_seconds is not None:
                _accept(lease, kept.stored, kept.hold_seconds)
            else:
                _complete(lease, kept.stored, held_as)
            # Announced, kept in memory and woken for once the outermost transaction commits.
            connection.on_commit(partial(_committed, lease, kept, time.monotonic()), robust=True)
    except _NotStored as not_stored:
        release(lease, not_stored.ended.value, held_as=held_as)
        return Ran(not_stored.ended, not_stored.value)
    except LeaseLost:
        instrumentation.lease_lost(lease.identity)
        raise
    except store.UNAVAILABLE_ERRORS as exc:
        instrumentation.store_unavailable(
            lease.identity, "database unavailable during the run", exc
        )
        if not handed_off:
            release(lease, "exception")
        raise
    except BaseException:
        if not handed_off:
            release(lease, "exception")
        raise
    return Ran(Ended.COMPLETED if kept.hold_seconds is None else Ended.HANDED_OFF, value, kept)


def _skipped(lease: Lease) -> Ran[Any]:
    """A delivery of handed-off work whose key is done, or no longer its own."""
    done = store.status_of(lease) == COMPLETED
    ended = Ended.ALREADY_COMPLETED if done else Ended.NOT_OURS
    instrumentation.hand_off_skipped(lease.identity, ended.value)
    return Ran(ended, None)


def _committed(lease: Lease, kept: Keep, stored_at: float) -> None:
    """After the commit of what a run stored (``stored_at``, monotonic): announce it, keep a
    final answer in this process's memory (``LOCAL_REPLAY_SECONDS``; Redis gets its copy at
    the first replay), and wake the duplicates waiting for it."""
    if kept.hold_seconds is not None:
        instrumentation.handed_off(
            lease, kept.stored
        )  # no copy of a 202: the worker's answer replaces it
    else:
        instrumentation.completed(lease, kept.stored)
        # The copy expires with the record, which was given its TTL when it was stored.
        ttl = (lease.ttl_seconds or conf.TTL_SECONDS) - (time.monotonic() - stored_at)
        memory.remember(lease.identity, kept.stored, ttl)
    attach.notify(lease.using, lease.identity)


@instrumentation.instrumented("complete")
def _complete(lease: Lease, stored: StoredResponse, held_as: str) -> None:
    """Store the answer; :class:`LeaseLost` (inside the span) when the key was taken over."""
    if not store.complete(lease, stored, held_as=held_as):
        raise LeaseLost("the lease was taken over by another request")


@instrumentation.instrumented("accept")
def _accept(lease: Lease, stored: StoredResponse, hold_seconds: float) -> None:
    """Store the 202 and hand the key to the worker; :class:`LeaseLost` when taken over."""
    if not store.accept(lease, stored, hold_seconds):
        raise LeaseLost("the lease was taken over by another request")


def release(lease: Lease, reason: str, *, held_as: str = PROCESSING) -> None:
    """Give the key back so a retry runs at once. Never raises: if the database is gone, the
    lease runs out instead and the retry takes the key over then.

    What this process kept of the key is forgotten at once (``key_released``); the waiters are
    woken once the release has committed.
    """
    try:
        released = store.release(lease, held_as=held_as)
    except store.UNAVAILABLE_ERRORS as exc:
        instrumentation.store_unavailable(
            lease.identity, "idempotency release failed; the key frees itself with its lease", exc
        )
        return
    if released:
        instrumentation.released(lease.identity, reason)
        transaction.on_commit(
            partial(attach.notify, lease.using, lease.identity), using=lease.using, robust=True
        )
