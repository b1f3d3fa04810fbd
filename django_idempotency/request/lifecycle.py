"""The request lifecycle: claim, run, complete or release, replay. Written once, here.

Every entry point is a door into this module: the middleware and ``@idempotent`` call
:func:`serve` (or :func:`serve_async` for async views); the DRF mixin calls :func:`admit` after
DRF's authentication and permissions, then :func:`run` around its handler. None of them does any
of the protocol itself. Below this module sit the rules (``core/statemachine.py``), the record
store (``store.py``, the database) and the Redis copy (``cache.py``); nothing below calls back up.

The rules a request meets, whichever door it came through:

* Not guarded (another method, no key where none is required, already guarded by an outer
  door): served exactly as Django would serve it, inside the ``ATOMIC_REQUESTS`` transactions.
* Guarded: the claim commits on its own first; then the view runs inside one transaction per
  database (the records' database and every ``ATOMIC_REQUESTS`` one), and its response is stored
  in that same transaction, fenced by the owner token.
* Nothing is stored, the key is released and the view's writes roll back when the view raises
  (DRF's validation, permission and throttling errors included), returns a response that is not
  to be stored (5xx by default, or one DRF made from an exception), or marks its transaction for
  rollback (``transaction.set_rollback(True)``, or a database error it caught); the client gets
  the view's own answer and a retry with the same key runs again.
* A duplicate of a request in flight gets 409 with ``Retry-After``, unless it may wait
  (``Prefer: wait=N``, or ``Options.wait``; ``attach.py``): then it waits, holding no
  connection, until the first request is done or its time runs out, and claims once more.
* A view may hand its work to a worker (``handoff.hand_off``, which enqueues the work through
  the outbox in the view's transaction and answers 202): its 202 is stored in that same
  transaction and the record becomes ACCEPTED, held by the worker under the same owner token.
  Duplicates replay the 202 (or wait for the final response, as above). The worker runs in a
  transaction that first takes the key up (:func:`finish_handed_off`) and stores the final
  response before it commits, so a redelivered task finds it done and never runs twice.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from django_idempotency.conf import GUARDED_METHODS, conf
from django_idempotency.core.statemachine import ACCEPTED, COMPLETED
from django_idempotency.core.types import (
    Conflict,
    Decision,
    Identity,
    Lease,
    Mismatch,
    Proceed,
    Replay,
    StoredResponse,
)
from django_idempotency.exceptions import (
    IdempotencyHTTPError,
    IdempotencyKeyMissing,
    LeaseLost,
    LeaseLostConflict,
    PayloadMismatch,
    StoreUnavailable,
    TransactionInProgress,
)
from django_idempotency.request import attach, cache, events, recent, store
from django_idempotency.request.fingerprint import (
    DJANGO_LIMIT,
    BodyLimit,
    hand_over_cleanup,
    recorded_path,
    request_fingerprint,
)
from django_idempotency.request.heartbeat import LeaseHeartbeat
from django_idempotency.request.keys import header, parse_key
from django_idempotency.request.responses import capture, problem_response
from django_idempotency.request.responses import replay as replay_response
from django_idempotency.request.scopes import resolve_scope

__all__ = [
    "HANDED_OFF",
    "UNAVAILABLE_ERRORS",
    "Attaching",
    "HandOff",
    "HandOffOutcome",
    "Options",
    "DEFAULT_OPTIONS",
    "admit",
    "atomic_requests",
    "claim",
    "default_should_store",
    "finish_handed_off",
    "guards",
    "identify",
    "opt_out_of_atomic_requests",
    "read_key",
    "reclaim",
    "refusal",
    "release",
    "remember_completion",
    "replay",
    "run",
    "serve",
    "serve_async",
    "serve_sync_view_async",
    "unhandled",
]

#: Database errors that mean "the database is not there", answered 503 rather than 500.
UNAVAILABLE_ERRORS = (OperationalError, InterfaceError)

ViewT = TypeVar("ViewT", bound=Callable[..., Any])
CallView = Callable[[], HttpResponseBase]
ErrorResponse = Callable[[IdempotencyHTTPError], HttpResponseBase]


def default_should_store(response: HttpResponseBase) -> bool:
    """Store a response the view returned with a status in ``STORED_STATUS_CODES``.

    A response DRF made from an exception (``response.exception``) is the exception's answer,
    not the view's: it is treated like the exception itself and never stored.
    """
    return response.status_code in conf.STORED_STATUS_CODES and not getattr(
        response, "exception", False
    )


@dataclass(frozen=True, slots=True)
class Options:
    """How one view (or the middleware) uses the lifecycle."""

    #: HTTP methods guarded; the others pass straight through.
    methods: Collection[str] = field(default_factory=lambda: frozenset(GUARDED_METHODS))
    #: Whether a response is final and stored (see :func:`default_should_store`).
    should_store: Callable[[HttpResponseBase], bool] = default_should_store
    #: Extend the lease from a background thread while the view runs (None: the setting).
    heartbeat: bool | None = None
    #: The largest body (not multipart) the fingerprint reads: Django's own
    #: ``DATA_UPLOAD_MAX_MEMORY_SIZE`` by default; more only for a view that streams its body.
    max_body: BodyLimit = DJANGO_LIMIT
    #: Seconds a duplicate of a request in flight waits for its answer instead of a 409, when
    #: it sends no ``Prefer: wait`` (None: ``ATTACH_DEFAULT_WAIT_SECONDS``, 0 by default).
    wait: float | None = None
    #: The view hands its work to a worker (``handoff.hand_off``) and answers 202: it needs a
    #: key whatever ``KEY_REQUIRED`` says, since the worker is fenced by the key's owner token.
    long_running: bool = False


DEFAULT_OPTIONS = Options()

#: The attribute ``handoff.hand_off`` sets on its 202 response (a :class:`HandOff`).
HANDED_OFF = "_idempotency_hand_off"


@dataclass(frozen=True, slots=True)
class HandOff:
    """A 202 that hands the key to a worker, which then holds it for ``hold_seconds``."""

    hold_seconds: float


@dataclass(frozen=True, slots=True)
class Attaching:
    """A duplicate that is to wait for ``identity`` (registered as ``waiter``), then claim again.

    What the sync part of :func:`serve_async` hands back, so the wait happens on the event loop.
    """

    identity: Identity
    waiter: attach.Waiter


# --- the doors' shared steps -------------------------------------------------------------------


def guards(request: HttpRequest, options: Options) -> bool:
    """Whether this request is the lifecycle's to guard (an outer door may have done it)."""
    return request.method in options.methods and getattr(request, "idempotency", None) is None


def read_key(request: HttpRequest, *, required: bool = False) -> str | None:
    """The request's key; ``None`` when it sent none and none is required (``required`` or
    ``KEY_REQUIRED``; 400s otherwise)."""
    raw = header(request, conf.HEADER)
    if raw is None:
        if required or conf.KEY_REQUIRED:
            raise IdempotencyKeyMissing(f"This endpoint requires an {conf.HEADER} header.")
        return None
    return parse_key(raw)


def admit(
    request: HttpRequest,
    *,
    scope: Callable[[], str],
    fingerprint: Callable[[], str],
    options: Options = DEFAULT_OPTIONS,
) -> Decision | None:
    """Read the key and claim it: what this request may do, or ``None`` when it has no key.

    A key held by a request in flight is waited for when the request may wait (``options.wait``
    or ``Prefer: wait``), then claimed once more: the caller gets what a retry would get then.
    Raises an :class:`IdempotencyHTTPError` for a missing or malformed key, a scope that cannot
    be told, or a database that cannot be reached (503).
    """
    decision = _admit(request, scope, fingerprint, options, detach=False)
    assert not isinstance(decision, Attaching)
    return decision


def _admit(
    request: HttpRequest,
    scope: Callable[[], str],
    fingerprint: Callable[[], str],
    options: Options,
    *,
    detach: bool,
) -> Decision | Attaching | None:
    """:func:`admit`; with ``detach``, a duplicate that may wait is handed back registered
    (:class:`Attaching`) instead of waiting in this thread."""
    key = read_key(request, required=options.long_running)
    if key is None:
        return None
    identity = identify(request, key, scope=scope(), fingerprint=fingerprint())
    decision = claim(identity)
    # A request in flight, or handed to a worker that is still at it: a duplicate may wait.
    in_flight = isinstance(decision, Conflict) or (
        isinstance(decision, Replay) and decision.handed_off
    )
    if not in_flight:
        return decision
    waiter = attach.enlist(
        request, identity, store.database_alias(), attach.patience(request, options.wait)
    )
    if waiter is None:
        return decision
    if detach:
        return Attaching(identity, waiter)
    with waiter:
        waiter.wait()
    return reclaim(identity)


def reclaim(identity: Identity) -> Decision:
    """The one claim a duplicate makes after waiting: whatever it says is the answer."""
    decision = claim(identity)
    events.attached(identity, decision)
    return decision


def identify(request: HttpRequest, key: str, *, scope: str, fingerprint: str) -> Identity:
    """What a claim is about: the key in its scope, and the request it must keep meaning."""
    return Identity(
        scope=scope,
        key=key,
        fingerprint=fingerprint,
        method=request.method or "",
        path=recorded_path(request),
    )


@events.instrumented("claim")
def claim(
    identity: Identity, *, lease_seconds: float | None = None, ttl_seconds: float | None = None
) -> Decision:
    """Claim a key: a replay kept in this process's memory or in Redis, else the record
    store's decision. A key this process answered lately (its next request is likely a retry)
    is read first: a replay, a 409 or a 422 needs no claim.

    ``lease_seconds`` and ``ttl_seconds`` override the settings for this key (see
    :func:`store.claim <django_idempotency.request.store.claim>`).
    """
    kept = recent.lookup(identity)
    decision: Decision | None = None if kept is None else Replay(kept)
    if decision is None:
        decision = cache.lookup(identity)
    if decision is None:
        try:
            if recent.answered(identity):
                decision = store.answer(identity)
            if decision is None:
                decision = store.claim(
                    identity, uuid.uuid4(), lease_seconds=lease_seconds, ttl_seconds=ttl_seconds
                )
        except DatabaseError as exc:
            answer = events.store_failed(identity, exc)
            if answer is None:
                raise
            raise answer from exc
        if isinstance(decision, Replay) and not decision.handed_off:
            # A key retried once is likely retried again: its next retries come from Redis.
            # Copied here, at its first replay, not at its completion: most keys are never
            # retried, and their requests then pay no Redis write and take no Redis memory.
            cache.remember(identity, decision.response, decision.expires_in)
    if kept is None and isinstance(decision, Replay) and not decision.handed_off:
        recent.remember(identity, decision.response, decision.expires_in)
    events.announce(identity, decision)
    return decision


@events.instrumented("replay")
def replay(stored: StoredResponse) -> HttpResponseBase:
    return replay_response(stored)


def refusal(decision: Conflict | Mismatch) -> IdempotencyHTTPError:
    """The HTTP error a retry gets when it may not run."""
    if isinstance(decision, Conflict):
        return TransactionInProgress(wait=decision.retry_after)
    return PayloadMismatch()


# --- running the view --------------------------------------------------------------------------


class _NotStored(Exception):
    """Leaves the transactions (rolling them back) with a response that is not stored."""

    def __init__(self, response: HttpResponseBase, reason: str) -> None:
        self.response = response
        self.reason = reason


def run(
    lease: Lease,
    call_view: CallView,
    options: Options = DEFAULT_OPTIONS,
    *,
    request: HttpRequest | None = None,
    view: Callable[..., Any] | None = None,
) -> HttpResponseBase:
    """Run the view and store its response in one transaction; release the key otherwise.

    ``call_view`` returns the final response (rendered here when it is a template response).
    Raises :class:`LeaseLostConflict` when another request took the key over meanwhile (the
    view's writes rolled back) and :class:`StoreUnavailable` when the database went away;
    re-raises whatever the view raised, after releasing the key.
    """
    if request is not None:
        request.idempotency = lease  # type: ignore[attr-defined]
    aliases = _transaction_aliases(lease.using, view)
    beat = conf.LEASE_HEARTBEAT if options.heartbeat is None else options.heartbeat
    if connections[lease.using].vendor == "sqlite":
        # SQLite has one writer at a time: while the view's transaction holds the write lock
        # nobody can take the key over, and a heartbeat could not write either.
        beat = False
    try:
        with LeaseHeartbeat(lease) if beat else nullcontext(), ExitStack() as transactions:
            # Entered in this order, left in reverse: the business databases commit before the
            # records' one, so a stored response never claims writes that failed to commit.
            for alias in aliases:
                transactions.enter_context(transaction.atomic(using=alias))
            response = call_view()
            if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
                response.render()
            hand_off: HandOff | None = getattr(response, HANDED_OFF, None)
            if any(connections[alias].needs_rollback for alias in aliases):
                if hand_off is not None:
                    # Its 202 would promise work that the rollback took back out of the outbox.
                    raise RuntimeError(
                        "The view handed its work off, then marked its transaction for "
                        "rollback: nothing was enqueued, so its 202 cannot be answered."
                    )
                raise _NotStored(response, "rolled_back")
            # A hand-off's 202 is always stored: its work is enqueued in this transaction.
            if hand_off is None and not options.should_store(response):
                raise _NotStored(response, "not_stored")
            stored = capture(response)
            if hand_off is not None:
                _accept(lease, stored, hand_off.hold_seconds)
            else:
                _complete(lease, stored)
            completed_at = time.monotonic()
    except _NotStored as not_stored:
        release(lease, not_stored.reason)
        return _first_time(not_stored.response)
    except LeaseLost as exc:
        events.lease_lost(lease.identity)
        raise LeaseLostConflict() from exc
    except UNAVAILABLE_ERRORS as exc:
        events.store_unavailable(lease.identity, "database unavailable during the request", exc)
        release(lease, "exception")
        raise StoreUnavailable() from exc
    except BaseException:
        release(lease, "exception")
        raise
    if hand_off is not None:
        # No Redis copy of a 202: the worker's final response replaces it.
        events.handed_off(lease, stored)
    else:
        remember_completion(lease, stored, completed_at)
    # After the commit (and the Redis copy): a woken duplicate's claim must find the response.
    attach.notify(lease.using, lease.identity)
    return _first_time(response)


def remember_completion(lease: Lease, stored: StoredResponse, completed_at: float) -> None:
    """Announce a completion just committed (``completed_at``, monotonic), and keep it in this
    process's memory (``LOCAL_REPLAY_SECONDS``). Redis gets its copy at the first replay."""
    events.completed(lease, stored)
    # The copy expires with the record, which was given its TTL at the commit just done.
    ttl = (lease.ttl_seconds or conf.TTL_SECONDS) - (time.monotonic() - completed_at)
    recent.remember(lease.identity, stored, ttl)


@events.instrumented("complete")
def _complete(lease: Lease, stored: StoredResponse) -> None:
    """Store the response; :class:`LeaseLost` (inside the span) when the key was taken over."""
    if not store.complete(lease, stored):
        raise LeaseLost("the lease was taken over by another request")


@events.instrumented("accept")
def _accept(lease: Lease, stored: StoredResponse, hold_seconds: float) -> None:
    """Store the 202 and hand the key to the worker; :class:`LeaseLost` when taken over."""
    if not store.accept(lease, stored, hold_seconds):
        raise LeaseLost("the lease was taken over by another request")


def release(lease: Lease, reason: str) -> None:
    """Give the key back so a retry runs at once. Never raises: if the database is gone, the
    lease runs out instead and the retry takes the key over then."""
    try:
        released = store.release(lease)
    except UNAVAILABLE_ERRORS as exc:
        events.store_unavailable(
            lease.identity, "idempotency release failed; the key frees itself with its lease", exc
        )
        return
    if released:
        events.released(lease.identity, reason)
        attach.notify(lease.using, lease.identity)


def _first_time(response: HttpResponseBase) -> HttpResponseBase:
    response[conf.REPLAY_HEADER] = "false"
    return response


# --- the worker of a handed-off request --------------------------------------------------------


class HandOffOutcome(enum.Enum):
    """What became of one delivery of a handed-off request's work."""

    #: The work ran and its final response is stored.
    COMPLETED = "completed"
    #: An earlier delivery completed it: nothing ran (a redelivery, a relay sending twice).
    ALREADY_COMPLETED = "already_completed"
    #: The key is no longer this hand-off's (its hold ran out and a retry took it over, or an
    #: operator released it): nothing ran; the new owner does the work.
    NOT_OURS = "not_ours"


def finish_handed_off(
    lease: Lease, work: Callable[[], HttpResponseBase]
) -> tuple[HandOffOutcome, HttpResponseBase | None]:
    """Run a handed-off request's work once, and store its final response with it.

    One transaction: take the key up (locking its row, so a second delivery of the same work
    waits for this one and then finds it done), run ``work``, store what it returns (replayed
    to retries from then on), commit. ``lease`` carries the key and the owner token the
    request handed over, and the worker's lease length (``lease_seconds``). If ``work``
    raises, everything rolls back and the key stays ACCEPTED: the task's own retry runs it
    again, and once the hold runs out a retry of the request takes the key over.
    """
    with transaction.atomic(using=lease.using):
        if not store.resume(lease):
            status = store.status_of(lease)
            outcome = (
                HandOffOutcome.ALREADY_COMPLETED if status == COMPLETED else HandOffOutcome.NOT_OURS
            )
            events.hand_off_skipped(lease.identity, outcome.value)
            return outcome, None
        response = work()
        if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
            response.render()
        stored = capture(response)
        if not store.complete(lease, stored, held_as=ACCEPTED):
            raise LeaseLost("the handed-off key changed hands while its row was locked")
        completed_at = time.monotonic()
    remember_completion(lease, stored, completed_at)
    attach.notify(lease.using, lease.identity)
    return HandOffOutcome.COMPLETED, response


# --- ATOMIC_REQUESTS ---------------------------------------------------------------------------


def opt_out_of_atomic_requests(view: ViewT) -> ViewT:
    """Stop Django wrapping ``view`` in ATOMIC_REQUESTS transactions; the lifecycle opens them.

    The claim must commit before the view's transaction opens: inside ATOMIC_REQUESTS it would
    commit only with the view, and concurrent duplicates would wait for the first request to
    finish. Guarded requests get their transactions from :func:`run`, the others from
    :func:`atomic_requests`, so nothing changes for them.
    """
    view._non_atomic_requests = set(connections)  # type: ignore[attr-defined]
    return view


def _atomic_aliases(view: Callable[..., Any] | None) -> list[str]:
    """The databases ATOMIC_REQUESTS would wrap ``view`` in, as Django decides it."""
    if view is not None and iscoroutinefunction(view):
        return []  # Django refuses ATOMIC_REQUESTS for async views; so do we
    skipped: set[str] = getattr(view, "_non_atomic_requests", set()) if view else set()
    return [
        alias
        for alias, settings_dict in connections.settings.items()
        if settings_dict.get("ATOMIC_REQUESTS") and alias not in skipped
    ]


def _transaction_aliases(records: str, view: Callable[..., Any] | None) -> list[str]:
    """The records' database first, then every other ATOMIC_REQUESTS database."""
    return [records, *(alias for alias in _atomic_aliases(view) if alias != records)]


def atomic_requests(view: Callable[..., Any] | None = None) -> ExitStack:
    """The transactions ATOMIC_REQUESTS would have opened, for a request the lifecycle leaves."""
    stack = ExitStack()
    for alias in _atomic_aliases(view):
        stack.enter_context(transaction.atomic(using=alias))
    return stack


def unhandled(call_view: CallView, view: Callable[..., Any] | None = None) -> HttpResponseBase:
    """Serve a request the lifecycle does not guard, exactly as Django would."""
    with atomic_requests(view):
        return call_view()


# --- the whole lifecycle, for the middleware and the decorator ---------------------------------


def serve(
    request: HttpRequest,
    call_view: CallView,
    options: Options,
    *,
    view: Callable[..., Any] | None = None,
    scope: Callable[[], str] | None = None,
    fingerprint: Callable[[], str] | None = None,
    error_response: ErrorResponse = problem_response,
) -> HttpResponseBase:
    """Guard one request from key to response. ``view`` is the view function being served
    (for its ATOMIC_REQUESTS opt-outs); ``scope`` and ``fingerprint`` override the defaults."""
    if not guards(request, options):
        return unhandled(call_view, view)
    served = _serve(
        request,
        call_view,
        options,
        view=view,
        scope=scope,
        fingerprint=fingerprint,
        error_response=error_response,
        detach=False,
    )
    assert not isinstance(served, Attaching)
    return served


def _serve(
    request: HttpRequest,
    call_view: CallView,
    options: Options,
    *,
    view: Callable[..., Any] | None,
    scope: Callable[[], str] | None = None,
    fingerprint: Callable[[], str] | None = None,
    error_response: ErrorResponse = problem_response,
    detach: bool,
) -> HttpResponseBase | Attaching:
    try:
        decision = _admit(
            request,
            scope or partial(resolve_scope, request),
            fingerprint or partial(request_fingerprint, request, max_body=options.max_body),
            options,
            detach=detach,
        )
        if isinstance(decision, Attaching):
            return decision
        response = _answer(request, decision, call_view, options, view, error_response)
    except IdempotencyHTTPError as error:
        response = error_response(error)
    return _finish(request, response)


def _answer(
    request: HttpRequest,
    decision: Decision | None,
    call_view: CallView,
    options: Options,
    view: Callable[..., Any] | None,
    error_response: ErrorResponse,
) -> HttpResponseBase:
    match decision:
        case None:
            return unhandled(call_view, view)
        case Replay(response=stored):
            return replay(stored)
        case Conflict() | Mismatch():
            return error_response(refusal(decision))
        case Proceed(lease=lease):
            return run(lease, call_view, options, request=request, view=view)


def _finish(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    return hand_over_cleanup(request, attach.preference_applied(request, response))


def _resume(
    request: HttpRequest,
    attaching: Attaching,
    call_view: CallView,
    options: Options,
    view: Callable[..., Any] | None,
) -> HttpResponseBase:
    """After an async duplicate's wait: claim once more and answer as the claim says."""
    try:
        decision = reclaim(attaching.identity)
        response = _answer(request, decision, call_view, options, view, problem_response)
    except IdempotencyHTTPError as error:
        response = problem_response(error)
    return _finish(request, response)


async def serve_async(
    request: HttpRequest,
    call_view: Callable[[], Awaitable[HttpResponseBase]],
    options: Options,
    *,
    view: Callable[..., Any] | None = None,
) -> HttpResponseBase:
    """:func:`serve` for an async view.

    The view's transaction must live in one thread. The lifecycle runs in the thread Django's
    async ORM calls use (``thread_sensitive``), and the async view inside it: its
    ``sync_to_async`` database calls then run in this same thread, inside the transaction that
    also stores the response. A request the lifecycle leaves alone never leaves the event loop,
    and a duplicate that waits for a request in flight waits on the event loop, not in that
    thread (:func:`_serve_from_loop`).
    """
    if not guards(request, options) or (
        header(request, conf.HEADER) is None and not conf.KEY_REQUIRED
    ):
        return await call_view()
    return await _serve_from_loop(request, async_to_sync(call_view), options, view)


async def serve_sync_view_async(
    request: HttpRequest,
    call_view: CallView,
    options: Options,
    *,
    view: Callable[..., Any] | None = None,
) -> HttpResponseBase:
    """:func:`serve` for a sync view served from async code (the middleware under ASGI): the
    view and the lifecycle run in the ``thread_sensitive`` thread, a wait on the event loop."""
    if not guards(request, options):
        return await sync_to_async(unhandled, thread_sensitive=True)(call_view, view)
    return await _serve_from_loop(request, call_view, options, view)


async def _serve_from_loop(
    request: HttpRequest,
    call: CallView,
    options: Options,
    view: Callable[..., Any] | None,
) -> HttpResponseBase:
    """The thread's part hands a duplicate that may wait back registered (:class:`Attaching`);
    the loop awaits it, holding no thread; a second part in the thread claims again."""
    served = await sync_to_async(_serve, thread_sensitive=True)(
        request, call, options, view=view, detach=True
    )
    if not isinstance(served, Attaching):
        return served
    with served.waiter:
        await served.waiter.wait_async()
    return await sync_to_async(_resume, thread_sensitive=True)(request, served, call, options, view)
