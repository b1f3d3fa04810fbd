"""The lifecycle of a key: claim, run, complete or release, replay. Written once, here.

Every entry point is a door into this module, and differs from the others only in how it reads
a key and what it makes of each outcome (a :class:`Door`): the middleware and ``@idempotent``
call :func:`serve` (or :func:`serve_async`); the DRF mixin calls :func:`admit` after DRF's
authentication, then :func:`run` around its handler; ``@idempotent_function`` calls
:func:`claim`; a handed-off request's worker calls ``run_step`` itself. The claim's outcome is
dispatched in one place (:func:`settle`), and every door's work runs through one step
(``run_step.py``, which stores the answer or releases the key). Below this module sit the run
step, the rules (``core/statemachine.py``), the claim (``claims.py``) and the record store
(``store.py``) in the database, the Redis copy (``redis_copy.py``) and the answers kept in
memory (``memory.py``); nothing below calls back up.

The rules a request meets, whichever door it came through:

* Not guarded (another method, no key where none is required, already guarded by an outer
  door): served exactly as Django would serve it, inside the ``ATOMIC_REQUESTS`` transactions.
* Guarded: the claim commits on its own first; then the work runs inside one transaction per
  database (the records' database and every ``ATOMIC_REQUESTS`` one), and its answer is stored
  in that same transaction, fenced by the owner token.
* Nothing is stored, the key is released and the work's writes roll back when the work raises
  (DRF's validation, permission and throttling errors included), returns an answer that is not
  to be stored (5xx by default, or one DRF made from an exception), or marks its transaction for
  rollback (``transaction.set_rollback(True)``, or a database error it caught); the client gets
  the view's own answer and a retry with the same key runs again.
* Caches hold only what committed: an answer reaches this process's memory, the Redis copy or
  the hints of keys answered lately only from ``on_commit`` of the outermost transaction that
  wrote or read it, and a release forgets it at once.
* A duplicate of a request in flight gets 409 with ``Retry-After``, unless it may wait
  (``Prefer: wait=N``, or ``Options.wait``; ``attach.py``): then it waits, holding no
  connection, until the first request is done or its time runs out, and claims once more.
* A view may hand its work to a worker (``handoff.hand_off``, which enqueues the work through
  the outbox in the view's transaction and answers 202): its 202 is stored in that same
  transaction and the record becomes ACCEPTED, held by the worker under the same owner token.
  Duplicates replay the 202 (or wait for the final response, as above). The worker's run step
  first takes the key up and stores the final answer before it commits, so a redelivered task
  finds it done and never runs twice; a worker that rolls back releases the key, as a view does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar, assert_never

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.db import DatabaseError, connections, transaction
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from django_idempotency.conf import GUARDED_METHODS, conf
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
from django_idempotency.request import attach, claims, instrumentation, memory, redis_copy, store
from django_idempotency.request.fingerprint import (
    DJANGO_LIMIT,
    BodyLimit,
    hand_over_cleanup,
    recorded_path,
    request_fingerprint,
)
from django_idempotency.request.keys import header, parse_key
from django_idempotency.request.responses import capture, problem_response
from django_idempotency.request.responses import replay as replay_response
from django_idempotency.request.run_step import HANDED_OFF, HandOff, Keep, run_step
from django_idempotency.request.scopes import resolve_scope

__all__ = [
    "Attaching",
    "Door",
    "Options",
    "DEFAULT_OPTIONS",
    "Refused",
    "Screen",
    "admit",
    "first_claim",
    "follow",
    "atomic_requests",
    "claim",
    "default_should_store",
    "guards",
    "identify",
    "opt_out_of_atomic_requests",
    "read_key",
    "reclaim",
    "refusal",
    "rendered",
    "replay",
    "run",
    "serve",
    "serve_async",
    "serve_sync_view_async",
    "settle",
    "unhandled",
]

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

#: What a door checks before a duplicate may wait, as it would check a new request (DRF's
#: permissions and throttles): returns if it may, raises the door's refusal otherwise.
Screen = Callable[[], None]


class Refused(Exception):  # noqa: N818 - an answer, not a failure
    """A door's own refusal of a duplicate that asked to wait (DRF's 403, 429): its response,
    answered as it is."""

    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__(response.status_code)
        self.response = response


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
    screen: Screen | None = None,
) -> Decision | None:
    """Read the key and claim it: what this request may do, or ``None`` when it has no key.

    A key held by a request in flight is waited for when the request may wait (``options.wait``
    or ``Prefer: wait``) and passes ``screen`` (the door's own checks of a new request, which
    raise its refusal), then claimed once more: the caller gets what a retry would get then.
    Raises an :class:`IdempotencyHTTPError` for a missing or malformed key, a scope that cannot
    be told, or a database that cannot be reached (503).
    """
    first = first_claim(request, scope, fingerprint, options)
    if first is None:
        return None
    return follow(request, *first, options, screen)


def _admit(
    request: HttpRequest,
    scope: Callable[[], str],
    fingerprint: Callable[[], str],
    options: Options,
    screen: Screen | None,
    *,
    detach: bool,
) -> Decision | Attaching | None:
    """:func:`admit`; with ``detach``, a duplicate that may wait is handed back registered
    (:class:`Attaching`) instead of waiting in this thread."""
    first = first_claim(request, scope, fingerprint, options)
    if first is None:
        return None
    return _follow(request, *first, options, screen, detach=detach)


def first_claim(
    request: HttpRequest,
    scope: Callable[[], str],
    fingerprint: Callable[[], str],
    options: Options,
) -> tuple[Identity, Decision] | None:
    """Read the key and claim it once, waiting for nothing: what it is about and what the claim
    said, or ``None`` when the request has no key. :func:`follow` takes it from there."""
    key = read_key(request, required=options.long_running)
    if key is None:
        return None
    identity = identify(request, key, scope=scope(), fingerprint=fingerprint())
    return identity, claim(identity)


def follow(
    request: HttpRequest,
    identity: Identity,
    decision: Decision,
    options: Options,
    screen: Screen | None = None,
) -> Decision:
    """What :func:`admit` decides after its :func:`first_claim` said ``decision``: for a key
    in flight that the request may wait for, the claim made once the wait ends."""
    followed = _follow(request, identity, decision, options, screen, detach=False)
    assert not isinstance(followed, Attaching)
    return followed


def _follow(
    request: HttpRequest,
    identity: Identity,
    decision: Decision,
    options: Options,
    screen: Screen | None,
    *,
    detach: bool,
) -> Decision | Attaching:
    # A request in flight, or handed to a worker that is still at it: a duplicate may wait.
    in_flight = isinstance(decision, Conflict) or (
        isinstance(decision, Replay) and decision.handed_off
    )
    if not in_flight:
        return decision
    wait = attach.patience(request, options.wait)
    if wait.seconds <= 0:
        return decision
    if screen is not None:
        # Before any wait, the checks a new request would meet: a client refused (or throttled)
        # does not get to hold a thread by asking to wait, and its wait counts as a request.
        screen()
    waiter = attach.enlist(request, identity, store.database_alias(), wait)
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
    instrumentation.attached(identity, decision)
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


@instrumentation.instrumented("claim")
def claim(
    identity: Identity, *, lease_seconds: float | None = None, ttl_seconds: float | None = None
) -> Decision:
    """Claim a key: an answer kept in this process's memory or the Redis copy, else the
    database's decision. A key this process answered lately (its next request is likely a retry)
    is read first: a replay, a 409 or a 422 needs no claim.

    ``lease_seconds`` and ``ttl_seconds`` override the settings for this key (see
    :func:`claims.claim <django_idempotency.request.claims.claim>`).
    """
    kept = memory.lookup(identity)
    if kept is not None:
        decision: Decision = Replay(kept)
        instrumentation.announce(identity, decision)
        return decision
    cached = redis_copy.lookup(identity)
    connection = connections[store.database_alias()]
    if cached is not None:
        decision = cached
    else:
        try:
            answered = claims.answer(identity, connection) if memory.answered(identity) else None
            decision = answered or claims.claim(
                identity,
                uuid.uuid4(),
                lease_seconds=lease_seconds,
                ttl_seconds=ttl_seconds,
                connection=connection,
            )
        except DatabaseError as exc:
            answer = instrumentation.store_failed(identity, exc)
            if answer is None:
                raise
            raise answer from exc
    if isinstance(decision, Replay) and not decision.handed_off:
        redis_copy.note_claim(replayed=True)
        # A key retried once is likely retried again: its next retries come from memory or
        # Redis. Copied to Redis here, at its first replay, not at its completion: most keys
        # are never retried, and their requests then pay no Redis write and take no memory.
        if connection.in_atomic_block:
            # Read inside a transaction that may have written the record and may still roll
            # back: no cache may answer for it before it commits.
            connection.on_commit(
                partial(_remember_replay, identity, decision, cached is None, time.monotonic()),
                robust=True,
            )
        else:
            _remember_replay(identity, decision, cached is None)
    else:
        redis_copy.note_claim(replayed=False)
    instrumentation.announce(identity, decision)
    return decision


def _remember_replay(
    identity: Identity, replay: Replay, copy: bool, read_at: float | None = None
) -> None:
    """Keep a committed replay in this process's memory, and (``copy``) in Redis, for the
    seconds its record has left (less what passed since it was read, at ``read_at``)."""
    left = replay.expires_in
    if left is not None and read_at is not None:
        left -= time.monotonic() - read_at
    if copy:
        redis_copy.remember(identity, replay.response, left)
    memory.remember(identity, replay.response, left)


@instrumentation.instrumented("replay")
def replay(stored: StoredResponse, headers: Mapping[str, str] | None = None) -> HttpResponseBase:
    return replay_response(stored, headers)


def refusal(decision: Conflict | Mismatch) -> IdempotencyHTTPError:
    """The HTTP error a retry gets when it may not run."""
    if isinstance(decision, Conflict):
        return TransactionInProgress(wait=decision.retry_after)
    return PayloadMismatch()


# --- the claim's outcome, dispatched once ------------------------------------------------------

R = TypeVar("R", covariant=True)


class Door(Protocol[R]):
    """What one entry point makes of each outcome of a claim (an HTTP response, a function's
    value, a DRF handler to call): the doors differ only here and in how they read a key."""

    def unkeyed(self) -> R:
        """No key, and none required: not guarded."""
        ...

    def replay(self, stored: StoredResponse) -> R:
        """The key's stored answer (a final one, or a hand-off's 202 while its worker runs)."""
        ...

    def refuse(self, decision: Conflict | Mismatch) -> R:
        """A request in flight holds the key, or the key was used for another request."""
        ...

    def proceed(self, lease: Lease) -> R:
        """The key is this request's: run it (:func:`run_step`)."""
        ...


def settle(decision: Decision | None, door: Door[R]) -> R:
    """Hand the claim's outcome to the door: the one place it is dispatched."""
    match decision:
        case None:
            return door.unkeyed()
        case Replay(response=stored):
            return door.replay(stored)
        case Conflict() | Mismatch():
            return door.refuse(decision)
        case Proceed(lease=lease):
            return door.proceed(lease)
    assert_never(decision)


# --- the view door's run -----------------------------------------------------------------------


def run(
    lease: Lease,
    call_view: CallView,
    options: Options = DEFAULT_OPTIONS,
    *,
    request: HttpRequest | None = None,
    view: Callable[..., Any] | None = None,
) -> HttpResponseBase:
    """Run the view through :func:`run_step`: its response stored, or the key released.

    ``call_view`` returns the final response (rendered here when it is a template response).
    Raises :class:`LeaseLostConflict` when another request took the key over meanwhile (the
    view's writes rolled back) and :class:`StoreUnavailable` when the database went away;
    re-raises whatever the view raised, after releasing the key.
    """
    if request is not None:
        request.idempotency = lease  # type: ignore[attr-defined]
    try:
        ran = run_step(
            lease,
            partial(rendered, call_view),
            partial(_keep_response, options),
            also=_atomic_aliases(view),
            heartbeat=options.heartbeat,
        )
    except LeaseLost as exc:
        raise LeaseLostConflict() from exc
    except store.UNAVAILABLE_ERRORS as exc:
        raise StoreUnavailable() from exc
    assert ran.value is not None
    return _first_time(ran.value)


def rendered(call: CallView) -> HttpResponseBase:
    """The response ``call`` returns, rendered when it is a template response: the stored
    bytes must be the ones sent."""
    response = call()
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        response.render()
    return response


def _keep_response(options: Options, response: HttpResponseBase) -> Keep | None:
    """A hand-off's 202 is always kept (its work is enqueued in this transaction); any other
    response when ``should_store`` says it is final."""
    hand_off: HandOff | None = getattr(response, HANDED_OFF, None)
    if hand_off is not None:
        return Keep(capture(response), hand_off.hold_seconds)
    if options.should_store(response):
        return Keep(capture(response))
    return None


def _first_time(response: HttpResponseBase) -> HttpResponseBase:
    response[conf.REPLAY_HEADER] = "false"
    return response


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
    screen: Screen | None = None,
) -> HttpResponseBase:
    """Guard one request from key to response. ``view`` is the view function being served
    (for its ATOMIC_REQUESTS opt-outs); ``scope`` and ``fingerprint`` override the defaults;
    ``screen`` is what a duplicate must pass before it may wait (see :func:`admit`)."""
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
        screen=screen,
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
    screen: Screen | None = None,
    detach: bool,
) -> HttpResponseBase | Attaching:
    try:
        decision = _admit(
            request,
            scope or partial(resolve_scope, request),
            fingerprint or partial(request_fingerprint, request, max_body=options.max_body),
            options,
            screen,
            detach=detach,
        )
        if isinstance(decision, Attaching):
            return decision
        response = _answer(request, decision, call_view, options, view, error_response)
    except IdempotencyHTTPError as error:
        response = error_response(error)
    except Refused as refused:
        response = refused.response
    return _finish(request, response)


def _answer(
    request: HttpRequest,
    decision: Decision | None,
    call_view: CallView,
    options: Options,
    view: Callable[..., Any] | None,
    error_response: ErrorResponse,
) -> HttpResponseBase:
    return settle(decision, _ViewDoor(request, call_view, options, view, error_response))


@dataclass(frozen=True, slots=True)
class _ViewDoor:
    """The middleware's and ``@idempotent``'s answer to each outcome of a claim."""

    request: HttpRequest
    call_view: CallView
    options: Options
    view: Callable[..., Any] | None
    error_response: ErrorResponse

    def unkeyed(self) -> HttpResponseBase:
        return unhandled(self.call_view, self.view)

    def replay(self, stored: StoredResponse) -> HttpResponseBase:
        return replay(stored)

    def refuse(self, decision: Conflict | Mismatch) -> HttpResponseBase:
        return self.error_response(refusal(decision))

    def proceed(self, lease: Lease) -> HttpResponseBase:
        return run(lease, self.call_view, self.options, request=self.request, view=self.view)


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
    scope: Callable[[], str] | None = None,
    fingerprint: Callable[[], str] | None = None,
    screen: Screen | None = None,
) -> HttpResponseBase:
    """:func:`serve` for an async view (``scope`` and ``fingerprint`` as there).

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
    return await _serve_from_loop(
        request, async_to_sync(call_view), options, view, screen, scope, fingerprint
    )


async def serve_sync_view_async(
    request: HttpRequest,
    call_view: CallView,
    options: Options,
    *,
    view: Callable[..., Any] | None = None,
    screen: Screen | None = None,
) -> HttpResponseBase:
    """:func:`serve` for a sync view served from async code (the middleware under ASGI): the
    view and the lifecycle run in the ``thread_sensitive`` thread, a wait on the event loop."""
    if not guards(request, options):
        return await sync_to_async(unhandled, thread_sensitive=True)(call_view, view)
    return await _serve_from_loop(request, call_view, options, view, screen)


async def _serve_from_loop(
    request: HttpRequest,
    call: CallView,
    options: Options,
    view: Callable[..., Any] | None,
    screen: Screen | None,
    scope: Callable[[], str] | None = None,
    fingerprint: Callable[[], str] | None = None,
) -> HttpResponseBase:
    """The thread's part hands a duplicate that may wait back registered (:class:`Attaching`);
    the loop awaits it, holding no thread; a second part in the thread claims again."""
    served = await sync_to_async(_serve, thread_sensitive=True)(
        request,
        call,
        options,
        view=view,
        scope=scope,
        fingerprint=fingerprint,
        screen=screen,
        detach=True,
    )
    if not isinstance(served, Attaching):
        return served
    with served.waiter:
        await served.waiter.wait_async()
    return await sync_to_async(_resume, thread_sensitive=True)(request, served, call, options, view)
