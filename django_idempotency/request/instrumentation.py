"""The engine's one instrumentation hook: a span around a step, and the claim's timing.

``engine.py`` decorates ``claim``, ``complete`` and ``replay`` with :func:`instrumented`; nothing
else in the state machine knows about metrics or traces. The claim's duration goes out as the
``claim_finished`` signal, which the Prometheus histogram (``metrics.py``) and any other
listener consume.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from django_idempotency import signals, tracing
from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request.keys import redact

P = ParamSpec("P")
R = TypeVar("R")

SPAN_PREFIX = "idempotency."


def instrumented(step: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run an engine step inside an ``idempotency.<step>`` span; time and announce claims."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            identity = _identity(args[0] if args else None)
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
                    if step == "claim" and identity is not None:
                        signals.claim_finished.send(
                            sender=IdempotencyRecord,
                            scope=identity.scope,
                            key=identity.key,
                            outcome=outcome,
                            duration=time.perf_counter() - started,
                        )

        return wrapper

    return decorate


def _identity(first: Any) -> Any:
    """The Identity a step is about: ``claim(identity)``, ``complete(lease, ...)``."""
    identity = getattr(first, "identity", first)
    return identity if hasattr(identity, "scope") and hasattr(identity, "key") else None


def _attributes(identity: Any, args: tuple[Any, ...]) -> dict[str, tracing.AttributeValue]:
    """Scope, key (redacted unless LOG_KEYS), method, and the response status when known."""
    attributes: dict[str, tracing.AttributeValue] = {}
    if identity is not None:
        attributes["idempotency.scope"] = identity.scope
        attributes["idempotency.key"] = identity.key if conf.LOG_KEYS else redact(identity.key)
        attributes["http.request.method"] = identity.method
    for arg in args:  # complete(lease, stored) and replay(Replay(response=stored))
        status = getattr(getattr(arg, "response", arg), "status", None)
        if isinstance(status, int):
            attributes["http.response.status_code"] = status
    return attributes


def _outcome(step: str, result: Any) -> str:
    # engine imports this module at import time, so its classes are looked up when called.
    from django_idempotency.request import engine

    match result:
        case engine.Proceed():
            return "claimed"
        case engine.Replay():
            return "replayed"
        case engine.Conflict():
            return "conflicted"
        case engine.Mismatch():
            return "mismatched"
    return {"complete": "completed", "replay": "replayed"}.get(step, "ok")


def _failure(exc: BaseException) -> str:
    from django_idempotency.exceptions import LeaseLost, StoreUnavailable

    if isinstance(exc, StoreUnavailable):
        return "unavailable"
    if isinstance(exc, LeaseLost):
        return "lease_lost"
    return "error"
