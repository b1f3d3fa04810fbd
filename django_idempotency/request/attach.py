"""Attach instead of 409: a duplicate of a request in flight may wait for that request's answer.

A duplicate that finds its key held by a running request (``Conflict``) and may wait
(``Prefer: wait=N``, or the view's default) registers a :class:`Waiter` here, lets go of its
database connections, and sleeps on an event until the key is no longer in flight or its time
runs out. Then the lifecycle claims once more and does what that claim says, exactly as a retry
would: a replay, a run of its own (the first request failed and released the key), 409 or 422.

Waking costs one query per tick for the whole process, never one per waiter:

* A completion or release in this process wakes its waiters at once (:func:`notify`, called by
  the lifecycle after the commit; a dict lookup when nobody waits).
* A duplicate may wait only once it has passed the checks a new request of its door meets
  (DRF's permissions and throttles: a wait counts against the throttle), and only while fewer
  than ``ATTACH_MAX_WAITERS`` wait in its process and ``ATTACH_MAX_WAITERS_PER_SCOPE`` in its
  scope: one client can never hold every thread of a server with waiting duplicates.
* One daemon thread per process, started with the first waiter and gone a second after the
  last, asks the records' database every ``ATTACH_POLL_SECONDS`` which of all the awaited keys
  are still running (PROCESSING, or ACCEPTED by a worker, with a running lease), in one
  statement per database, and wakes the waiters of the others: completed, released, or whose
  lease ran out. It closes its
  connection when it stops, and a database error costs it one tick, never the waiters: a waiter
  whose time runs out claims again anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType

from django.db import connections
from django.db.models import Q
from django.http import HttpRequest, HttpResponseBase

from django_idempotency.conf import DEFAULTS, conf
from django_idempotency.core import leases
from django_idempotency.core.types import Identity
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.models import IdempotencyRecord

__all__ = [
    "PREFERENCE_APPLIED",
    "Patience",
    "Waiter",
    "enlist",
    "notify",
    "patience",
    "prefer_wait",
    "preference_applied",
    "waiting",
]

logger = logging.getLogger("django_idempotency.request")

#: The response header that says the request's ``Prefer: wait`` was honoured (RFC 7240 §3).
PREFERENCE_APPLIED = "Preference-Applied"
#: RFC 9111 §1.2.2: a delta-seconds too large to represent is taken as 2**31. It is capped by
#: ``ATTACH_MAX_WAIT_SECONDS`` long before that matters.
_HUGE = 2**31
#: How long the poller thread stays after the last waiter left before it closes its
#: connection and stops.
_LINGER_SECONDS = 1.0
#: Where the lifecycle notes, on the request, the seconds a duplicate was granted to wait.
_GRANTED = "_idempotency_wait_granted"


# --- Prefer: wait ------------------------------------------------------------------------------


def _preferences(header: str) -> Iterable[str]:
    """The comma-separated preferences of a header, commas inside quoted strings kept."""
    current: list[str] = []
    quoted = escaped = False
    for char in header:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            yield "".join(current)
            current = []
            continue
        current.append(char)
    yield "".join(current)


def prefer_wait(header: str | None) -> int | None:
    """The ``wait`` preference of a ``Prefer`` header (RFC 7240 §4.3), in seconds.

    ``None`` when the header has none, or when its first ``wait`` is not delta-seconds (digits,
    optionally quoted): a malformed preference is ignored, never an error (§2). Only the first
    ``wait`` counts (§2); names are case-insensitive; parameters after ``;`` are ignored. A value
    too large to represent is ``2**31`` (RFC 9111 §1.2.2), which the caller caps.
    """
    if not header:
        return None
    for preference in _preferences(header):
        name, equals, value = preference.partition(";")[0].partition("=")
        if name.strip().lower() != "wait":
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        if not equals or not value or not (value.isascii() and value.isdigit()):
            return None
        # Python refuses to convert very long digit strings; such a number is huge anyway.
        return _HUGE if len(value) > 10 else min(int(value), _HUGE)
    return None


@dataclass(frozen=True, slots=True)
class Patience:
    """How long a duplicate of a request may wait, and the ``wait`` the request asked for."""

    seconds: float
    #: The request's own ``Prefer: wait``; None when it sent none (or a malformed one).
    asked: int | None = None


def _poll_seconds() -> float:
    """The poller's tick; the default while the setting is wrong (the checks say so), since
    the poller thread has nobody to raise to."""
    try:
        return max(0.001, conf.ATTACH_POLL_SECONDS)
    except IdempotencyConfigurationError:
        return float(DEFAULTS["ATTACH_POLL_SECONDS"])


def patience(request: HttpRequest, default: float | None) -> Patience:
    """The request's ``Prefer: wait`` if it sent one, else ``default`` (None: the setting),
    capped at ``ATTACH_MAX_WAIT_SECONDS``."""
    cap = max(0.0, conf.ATTACH_MAX_WAIT_SECONDS)
    asked = prefer_wait(request.headers.get("Prefer"))
    if asked is not None:
        return Patience(min(float(asked), cap), asked)
    if default is None:
        default = conf.ATTACH_DEFAULT_WAIT_SECONDS
    seconds = 0.0 if math.isnan(default) else float(default)
    return Patience(min(max(0.0, seconds), cap))


def preference_applied(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    """Say ``Preference-Applied: wait=N`` on the answer to a request that asked to wait and did
    (N: the whole seconds it was granted, after the cap)."""
    granted = getattr(request, _GRANTED, None)
    if granted is not None:
        response[PREFERENCE_APPLIED] = f"wait={granted}"
    return response


# --- waiters -----------------------------------------------------------------------------------


@dataclass(eq=False)
class Waiter:
    """One duplicate waiting for a key: woken by :func:`notify`, the poller, or its deadline.

    Used as a context manager: leaving it takes the waiter off the registry, whatever happened.
    """

    using: str
    scope: str
    key: str
    deadline: float
    _event: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _future: asyncio.Future[None] | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        with self._lock:
            self._event.set()
            loop, future = self._loop, self._future
        if loop is not None and future is not None:
            # A closed loop has nobody waiting on it any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    @property
    def woken(self) -> bool:
        return self._event.is_set()

    def wait(self) -> bool:
        """Block this thread until woken or the deadline; whether it was woken."""
        return self._event.wait(max(0.0, self.deadline - time.monotonic()))

    async def wait_async(self) -> bool:
        """Wait on the running event loop, holding no thread; whether it was woken."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._event.is_set():
                return True
            self._loop, self._future = loop, future
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(future, max(0.0, self.deadline - time.monotonic()))
        return self._event.is_set()

    def __enter__(self) -> Waiter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _registry.remove(self)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Registry:
    """The waiters of this process, by (database, scope, key), and the one poller thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiters: dict[tuple[str, str, str], set[Waiter]] = {}
        self.count = 0
        #: Waiters per scope: one client never holds more than ``ATTACH_MAX_WAITERS_PER_SCOPE``.
        self.by_scope: dict[str, int] = {}
        self.poller: threading.Thread | None = None
        #: Statements the poller has run, for tests and curiosity.
        self.polls = 0

    def add(self, waiter: Waiter, limit: int, per_scope: int) -> bool:
        with self._lock:
            if self.count >= limit or self.by_scope.get(waiter.scope, 0) >= per_scope:
                return False
            self.waiters.setdefault((waiter.using, waiter.scope, waiter.key), set()).add(waiter)
            self.count += 1
            self.by_scope[waiter.scope] = self.by_scope.get(waiter.scope, 0) + 1
            if self.poller is None:
                self.poller = threading.Thread(
                    target=self._poll, name="django-idempotency-attach", daemon=True
                )
                self.poller.start()
        return True

    def remove(self, waiter: Waiter) -> None:
        with self._lock:
            waiting = self.waiters.get((waiter.using, waiter.scope, waiter.key))
            if waiting is None or waiter not in waiting:
                return
            waiting.discard(waiter)
            self.count -= 1
            left = self.by_scope.pop(waiter.scope) - 1
            if left:
                self.by_scope[waiter.scope] = left
            if not waiting:
                del self.waiters[(waiter.using, waiter.scope, waiter.key)]

    def wake(self, awaited: Iterable[tuple[str, str, str]]) -> None:
        with self._lock:
            woken = [waiter for name in awaited for waiter in self.waiters.get(name, ())]
        for waiter in woken:
            waiter.wake()

    def _forget_abandoned(self) -> None:
        """Drop waiters long past their deadline: a waiter leaves the registry itself when it
        stops waiting, so one still here was abandoned (its async task cancelled between its
        registration and its wait) and must not hold a place or keep the poller going."""
        stale = time.monotonic() - _LINGER_SECONDS
        with self._lock:
            abandoned = [w for ws in self.waiters.values() for w in ws if w.deadline < stale]
        for waiter in abandoned:
            self.remove(waiter)

    def _poll(self) -> None:
        """The poller: one statement per database and tick for every awaited key, while any.

        It stays a moment after the last waiter left (``_LINGER_SECONDS``, no statements), so a
        burst of duplicates does not start a thread and connect to the database each time.
        """
        idle_since: float | None = None
        try:
            while True:
                time.sleep(_poll_seconds())
                self._forget_abandoned()
                with self._lock:
                    if not self.waiters:
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since >= _LINGER_SECONDS:
                            self.poller = None
                            return
                        continue
                    idle_since = None
                    awaited = list(self.waiters)
                by_database: dict[str, list[tuple[str, str]]] = {}
                for using, scope, key in awaited:
                    by_database.setdefault(using, []).append((scope, key))
                for using, pairs in by_database.items():
                    try:
                        running = still_running(using, pairs)
                    except Exception as exc:
                        logger.warning(
                            "idempotency attach poller: query failed; trying again next tick",
                            extra={"idempotency_event": "attach_poll_failed"},
                            exc_info=exc,
                        )
                        _close(using)
                        continue
                    self.wake(
                        (using, scope, key) for scope, key in pairs if (scope, key) not in running
                    )
        finally:
            connections.close_all()


def still_running(using: str, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of these (scope, key) pairs are held by a running request: one statement.

    Each pair is named by the unique (scope, key), so a table distributed by scope still routes
    the statement by its keys. Runs in autocommit: each statement sees the latest commits, also
    under MariaDB's REPEATABLE READ.
    """
    _registry.polls += 1
    named = Q()
    for scope, key in pairs:
        named |= Q(scope=scope, key=key)
    rows = (
        IdempotencyRecord.objects.using(using)
        .filter(named, leases.running_q())
        .values_list("scope", "key")
    )
    return {(str(scope), str(key)) for scope, key in rows}


def _close(using: str) -> None:
    # A broken connection that will not even close is dropped all the same.
    with contextlib.suppress(Exception):
        connections[using].close()


_registry = _Registry()


def waiting() -> int:
    """How many duplicates wait in this process."""
    return _registry.count


def enlist(request: HttpRequest, identity: Identity, using: str, wait: Patience) -> Waiter | None:
    """Register a waiter for a key in flight; None when it may not wait (no patience, or
    ``ATTACH_MAX_WAITERS`` already waiting in this process, or ``ATTACH_MAX_WAITERS_PER_SCOPE``
    of its scope: the caller answers 409 at once).

    A registered waiter has let go of this thread's database connections (none is in a
    transaction: the lifecycle opts its views out of ``ATOMIC_REQUESTS``), so a hundred waiters
    hold no connection of a pool.
    """
    if wait.seconds <= 0:
        return None
    waiter = Waiter(using, identity.scope, identity.key, time.monotonic() + wait.seconds)
    if not _registry.add(waiter, conf.ATTACH_MAX_WAITERS, conf.ATTACH_MAX_WAITERS_PER_SCOPE):
        return None
    if wait.asked is not None:
        setattr(request, _GRANTED, math.ceil(wait.seconds))
    _let_go_of_connections()
    return waiter


def _let_go_of_connections() -> None:
    for connection in connections.all(initialized_only=True):
        if connection.connection is not None and not connection.in_atomic_block:
            connection.close()


def notify(using: str, identity: Identity) -> None:
    """The key is no longer in flight (completed or released here): wake its waiters now."""
    if _registry.waiters:  # read without the lock: a miss is caught by the poller's next tick
        _registry.wake([(using, identity.scope, identity.key)])
