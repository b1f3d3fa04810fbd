"""What the request lifecycle tells the world: signals, log lines and spans, in one place.

The lifecycle calls these functions at each step; nothing else in the request layer sends a
signal or writes a log line about a key, so every line carries the same fields: the event, the
scope, the key (redacted unless ``LOG_KEYS``), the method and the path. Spans wrap a step with
:func:`instrumented`; the claim's duration goes out as the ``claim_finished`` signal, which the
Prometheus histogram (``observability/metrics.py``) and any other listener consume.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from django.db import InterfaceError, OperationalError, router

from django_idempotency import signals
from django_idempotency.conf import conf
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
from django_idempotency.db import schema_missing
from django_idempotency.exceptions import LeaseLost, StoreNotMigrated, StoreUnavailable
from django_idempotency.models import IdempotencyRecord
from django_idempotency.observability import tracing
from django_idempotency.request.keys import redact

__all__ = [
    "SPAN_PREFIX",
    "announce",
    "attached",
    "completed",
    "hand_off_skipped",
    "handed_off",
    "instrumented",
    "lease_lost",
    "log_fields",
    "redis_copy_failed",
    "released",
    "store_failed",
    "store_unavailable",
]

logger = logging.getLogger("django_idempotency.request")

P = ParamSpec("P")
R = TypeVar("R")

SPAN_PREFIX = "idempotency."


def log_fields(identity: Identity, event: str, **fields: Any) -> dict[str, Any]:
    """The structured ``extra=`` of every log line about a key."""
    return {
        "idempotency_event": event,
        "idempotency_scope": identity.scope,
        "idempotency_key": identity.key if conf.LOG_KEYS else redact(identity.key),
        "idempotency_method": identity.method,
        "idempotency_path": identity.path,
        **{f"idempotency_{name}": value for name, value in fields.items()},
    }


def announce(identity: Identity, decision: Decision) -> None:
    """A claim's outcome: its signal, and an INFO line for everything but a plain first claim."""
    match decision:
        case Proceed(lease=lease):
            _send(signals.key_claimed, identity, attempt=lease.attempt)
            if lease.taken_over:
                _info("idempotency key taken over", identity, "taken_over", attempt=lease.attempt)
                _send(signals.key_taken_over, identity, attempt=lease.attempt)
        case Replay(response=stored):
            _info("idempotency replay", identity, "replayed", status=stored.status)
            _send(signals.response_replayed, identity, status=stored.status)
        case Conflict(retry_after=retry_after):
            _info("idempotency conflict", identity, "conflicted", retry_after=retry_after)
            _send(signals.request_conflicted, identity, retry_after=retry_after)
        case Mismatch():
            _info("idempotency payload mismatch", identity, "mismatched")
            _send(signals.payload_mismatched, identity)


def attached(identity: Identity, decision: Decision) -> None:
    """A duplicate that waited for a request in flight, and what its claim then said."""
    outcome = {
        Replay: "replayed",
        Proceed: "proceeded",
        Conflict: "conflicted",
        Mismatch: "mismatched",
    }[type(decision)]
    _info("idempotency duplicate attached", identity, "attached", outcome=outcome)


def completed(lease: Lease, stored: StoredResponse) -> None:
    _send(signals.request_completed, lease.identity, status=stored.status, retained=stored.retained)


def handed_off(lease: Lease, stored: StoredResponse) -> None:
    """A request answered 202 and handed its key to a worker (ACCEPTED)."""
    _info("idempotency request handed off", lease.identity, "handed_off", status=stored.status)
    _send(signals.request_handed_off, lease.identity, status=stored.status)


def hand_off_skipped(identity: Identity, outcome: str) -> None:
    """A delivery of handed-off work found the key done or no longer its own: nothing ran."""
    _info("idempotency handed-off work skipped", identity, "hand_off_skipped", outcome=outcome)


def released(identity: Identity, reason: str) -> None:
    _send(signals.key_released, identity, reason=reason)


def lease_lost(identity: Identity) -> None:
    logger.warning("idempotency lease lost", extra=log_fields(identity, "lease_lost"))
    _send(signals.lease_lost, identity)


def store_unavailable(identity: Identity, message: str, exc: BaseException) -> None:
    logger.warning(message, extra=log_fields(identity, "store_unavailable"), exc_info=exc)


def store_failed(identity: Identity, exc: BaseException) -> StoreUnavailable | None:
    """The answer to a database error while claiming, logged: ``StoreNotMigrated`` when the
    app's tables are missing, ``StoreUnavailable`` when the database cannot be reached; None for
    any other error, which is a bug to raise as it is."""
    if schema_missing(exc):
        # One line that names the fix, no traceback: the cause is known, and it repeats on
        # every request until someone migrates.
        logger.error(
            "idempotency claim failed: database %r lacks django_idempotency's tables (%s); run "
            "`manage.py migrate django_idempotency`",
            router.db_for_write(IdempotencyRecord),
            exc,
            extra=log_fields(identity, "store_not_migrated"),
        )
        return StoreNotMigrated()
    if isinstance(exc, OperationalError | InterfaceError):
        store_unavailable(identity, "idempotency claim failed: database unavailable", exc)
        return StoreUnavailable()
    return None


def redis_copy_failed(
    operation: str, scope: str, key: str, exc: BaseException, level: int = logging.WARNING
) -> None:
    """A Redis error: logged, and sent as ``redis_copy_failed``; the database answers instead."""
    logger.log(
        level,
        "idempotency Redis copy failed; using the database",
        extra={
            "idempotency_event": "redis_copy_failed",
            "idempotency_operation": operation,
            "idempotency_scope": scope,
            "idempotency_key": key if conf.LOG_KEYS else redact(key),
        },
        exc_info=exc,
    )
    signals.redis_copy_failed.send(
        sender=IdempotencyRecord, scope=scope, key=key, operation=operation, error=exc
    )


def _info(message: str, identity: Identity, event: str, **fields: Any) -> None:
    # Checked first: building the fields hashes the key, on every request.
    if logger.isEnabledFor(logging.INFO):
        logger.info(message, extra=log_fields(identity, event, **fields))


def _send(signal: Any, identity: Identity, **kwargs: Any) -> None:
    signal.send(sender=IdempotencyRecord, scope=identity.scope, key=identity.key, **kwargs)


# --- spans -------------------------------------------------------------------------------------


def instrumented(step: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run a lifecycle step inside an ``idempotency.<step>`` span; time and announce claims.

    The step's first argument is the :class:`Identity` it is about, or something carrying one
    (a :class:`Lease`).
    """

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        timed = step == "claim"

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            # Nobody listens and no span would be made (the usual case for every step but a
            # claim under Prometheus): the step alone, without the timing and the span's frame.
            if not (timed and signals.claim_finished.receivers) and not tracing.enabled():
                return func(*args, **kwargs)
            first: Any = args[0] if args else None
            found = getattr(first, "identity", first)
            identity = found if isinstance(found, Identity) else None
            started = time.perf_counter()
            outcome = "error"
            with tracing.step_span(SPAN_PREFIX + step, lambda: _attributes(identity, args)) as span:
                try:
                    result = func(*args, **kwargs)
                    outcome = _outcome(step, result)
                    return result
                except BaseException as exc:
                    outcome = _failure(exc)
                    raise
                finally:
                    if span is not None:
                        span.set_attribute("idempotency.outcome", outcome)
                    if timed and identity is not None:
                        signals.claim_finished.send(
                            sender=IdempotencyRecord,
                            scope=identity.scope,
                            key=identity.key,
                            outcome=outcome,
                            duration=time.perf_counter() - started,
                        )

        return wrapper

    return decorate


def _attributes(
    identity: Identity | None, args: tuple[Any, ...]
) -> dict[str, tracing.AttributeValue]:
    """Scope, key (redacted unless LOG_KEYS), method, and the response status when known."""
    attributes: dict[str, tracing.AttributeValue] = {}
    if identity is not None:
        attributes["idempotency.scope"] = identity.scope
        attributes["idempotency.key"] = identity.key if conf.LOG_KEYS else redact(identity.key)
        attributes["http.request.method"] = identity.method
    for arg in args:  # complete(lease, stored) and replay(stored)
        if isinstance(arg, StoredResponse):
            attributes["http.response.status_code"] = arg.status
    return attributes


def _outcome(step: str, result: Any) -> str:
    match result:
        case Proceed():
            return "claimed"
        case Replay():
            return "replayed"
        case Conflict():
            return "conflicted"
        case Mismatch():
            return "mismatched"
    return {"complete": "completed", "replay": "replayed", "accept": "accepted"}.get(step, "ok")


def _failure(exc: BaseException) -> str:
    if isinstance(exc, StoreUnavailable):
        return "unavailable"
    if isinstance(exc, LeaseLost):
        return "lease_lost"
    return "error"
