"""OpenTelemetry spans, and the W3C ``traceparent`` helpers that tie a message to its request.

Optional: the ``otel`` extra. Without ``opentelemetry-api``, or with
``IDEMPOTENCY["TRACING"] = False``, every helper here is a no-op. Only the API is used: spans go
wherever the application's tracer provider sends them (nowhere until one is configured).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django_idempotency import __version__
from django_idempotency.conf import conf

__all__ = [
    "AttributeValue",
    "TRACEPARENT",
    "TRACER_NAME",
    "consumer_span",
    "current_traceparent",
    "enabled",
    "producer_span",
    "set_error",
    "step_span",
]

if TYPE_CHECKING:
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import Span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
else:
    try:
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:  # pragma: no cover - exercised only without the otel extra
        otel_trace = None
    Span = Any

#: What ``get_tracer_provider()`` returns before an application sets a provider.
_NO_PROVIDER: tuple[type, ...] = (
    (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider) if otel_trace else ()
)

TRACER_NAME = "django_idempotency"
TRACEPARENT = "traceparent"

AttributeValue = str | bool | int | float


def enabled() -> bool:
    """Spans are made: OpenTelemetry is installed, ``TRACING`` is on, and a tracer provider has
    been set (until one is, every span would be a no-op, its attributes computed for nothing:
    the key hashed, on every request)."""
    return (
        otel_trace is not None
        and conf.TRACING
        and not isinstance(otel_trace.get_tracer_provider(), _NO_PROVIDER)
    )


def _tracer() -> otel_trace.Tracer:
    # Looked up on each use, so a tracer provider installed after import is honoured.
    return otel_trace.get_tracer(TRACER_NAME, __version__)


@contextmanager
def step_span(
    name: str, attributes: Callable[[], Mapping[str, AttributeValue]]
) -> Iterator[Span | None]:
    """A span around one lifecycle step, child of the current (request) span; exceptions recorded.

    ``attributes`` is called only when a span is made: it hashes the key, on every request.
    """
    if not enabled():
        yield None
        return
    with _tracer().start_as_current_span(name, attributes=dict(attributes())) as span:
        yield span


def set_error(span: Span, description: str) -> None:
    """Mark ``span`` as failed (ERROR status) without an exception to record."""
    span.set_status(otel_trace.StatusCode.ERROR, description)


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, to store beside an event it causes.

    Always the W3C format, whatever propagator the application configured globally, because
    the stored value must be readable by :func:`consumer_span` in any other process.
    """
    if not enabled():
        return None
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get(TRACEPARENT)


def _links(traceparents: Iterable[str | None]) -> list[otel_trace.Link]:
    """One link per distinct valid ``traceparent``; missing and malformed ones are skipped."""
    links: list[otel_trace.Link] = []
    seen: set[str] = set()
    for traceparent in traceparents:
        if not traceparent or traceparent in seen:
            continue
        seen.add(traceparent)
        context = TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})
        linked = otel_trace.get_current_span(context).get_span_context()
        if linked.is_valid:
            links.append(otel_trace.Link(linked))
    return links


@contextmanager
def consumer_span(
    name: str,
    traceparent: str | None,
    *,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Iterator[Span | None]:
    """A CONSUMER span linked to the span whose ``traceparent`` was stored with the message.

    A link, not a parent: the consumer's span stays in the consumer's own trace (a Celery task's,
    say), and tracing back-ends follow the link to the HTTP request that published the message.
    A missing or malformed ``traceparent`` gives a span without a link.
    """
    with _linked_span(name, "CONSUMER", [traceparent], attributes) as span:
        yield span


@contextmanager
def producer_span(
    name: str,
    traceparents: Iterable[str | None],
    *,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Iterator[Span | None]:
    """A PRODUCER span for sending a batch, linked to the span that published each message.

    The relay runs in a trace of its own; one span per batch sent to a publisher, with a link to
    each distinct stored ``traceparent``, as the messaging conventions do for batches.
    """
    with _linked_span(name, "PRODUCER", traceparents, attributes) as span:
        yield span


@contextmanager
def _linked_span(
    name: str,
    kind: str,
    traceparents: Iterable[str | None],
    attributes: Mapping[str, AttributeValue] | None,
) -> Iterator[Span | None]:
    if not enabled():
        yield None
        return
    with _tracer().start_as_current_span(
        name,
        kind=otel_trace.SpanKind[kind],
        links=_links(traceparents),
        attributes=dict(attributes or {}),
    ) as span:
        yield span
