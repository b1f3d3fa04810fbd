"""Hand a claimed batch to the routes' publishers, with no transaction open.

Network I/O never holds a lock or a snapshot: the claim has committed the batch's lease, and
the acknowledgement records the outcomes in a transaction of its own. Within the batch a key's
events go out one wave at a time, so a failure holds back the rest of that key (and only that
key) until the failed event is published.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from django_idempotency.core.failures import FailureKind, describe, failure_kind
from django_idempotency.exceptions import OutboxError
from django_idempotency.models import OutboxEvent
from django_idempotency.observability import tracing
from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.publishers.routing import PublisherSet

__all__ = ["REFUSED_ROUTE_SECONDS", "SEND_SPAN", "Sender", "send"]

#: The PRODUCER span around each batch handed to a publisher, linked to the publishing spans.
SEND_SPAN = "outbox.publish"
#: After a route's broker refused it (a configuration error), the relay fails that route's
#: retried events for this long without asking the broker again: however large the backlog
#: that comes due, a relay presents wrong credentials at most once a minute. New events, and
#: events an operator retried, are always tried.
REFUSED_ROUTE_SECONDS = 60.0

#: What became of each event attempted: None when its publisher accepted it, else the error.
Outcomes = dict[int, BaseException | None]


class Sender:
    """Sends a relay's batches. It keeps the publishers (and their broker connections) between
    batches, and remembers which routes' brokers refused them lately."""

    def __init__(self) -> None:
        self.publishers = PublisherSet()
        #: The publisher (its class name) each event of the last batch went to, by event id:
        #: the signals and the route failures name it, and take it from here.
        self.publisher_names: dict[int, str] = {}
        #: Routes whose broker refused them lately: until when, and the refusal.
        self._refused: dict[Publisher, tuple[float, BaseException]] = {}

    def close(self) -> None:
        self.publishers.close()

    def send_batch(self, events: list[OutboxEvent], deadline: float) -> Outcomes:
        """Publish in waves of at most one event per key, until ``deadline`` (monotonic);
        the outcome of each event attempted. A key whose event failed sends nothing more in
        this batch."""
        self.publisher_names.clear()
        outcomes: Outcomes = {}
        failed_keys: set[str] = set()
        remaining = events
        while remaining and time.monotonic() < deadline:
            wave: list[OutboxEvent] = []
            later: list[OutboxEvent] = []
            wave_keys: set[str] = set()
            for event in remaining:
                if event.key in failed_keys:
                    continue
                if event.key in wave_keys:
                    later.append(event)
                    continue
                wave.append(event)
                if event.key:
                    wave_keys.add(event.key)
            for publisher, group in self._by_publisher(wave, outcomes):
                for event in group:
                    self.publisher_names[event.pk] = type(publisher).__name__
                results = self._send_unless_refused(publisher, group)
                for event, error in zip(group, results, strict=True):
                    outcomes[event.pk] = error
                    if error is not None and event.key:
                        failed_keys.add(event.key)
            remaining = later
        return outcomes

    def _by_publisher(
        self, wave: list[OutboxEvent], outcomes: Outcomes
    ) -> Iterator[tuple[Publisher, list[OutboxEvent]]]:
        groups: dict[int, tuple[Publisher, list[OutboxEvent]]] = {}
        for event in wave:
            try:
                publisher = self.publishers.for_topic(event.topic)
            except Exception as exc:  # unroutable, or a publisher that cannot be built
                outcomes[event.pk] = exc
                continue
            groups.setdefault(id(publisher), (publisher, []))[1].append(event)
        yield from groups.values()

    def _send_unless_refused(
        self, publisher: Publisher, group: list[OutboxEvent]
    ) -> list[BaseException | None]:
        """Send the group, except that while the route's broker refuses it (a configuration
        error within ``REFUSED_ROUTE_SECONDS``), events that failed before fail again with
        that refusal, unsent. A refusal starts the window; a message accepted ends it."""
        refused_until, refusal = self._refused.get(publisher, (0.0, None))
        held = refusal is not None and time.monotonic() < refused_until
        to_send = [event for event in group if not (held and event.attempts)]
        sent = dict(
            zip(
                (event.pk for event in to_send),
                send(publisher, to_send) if to_send else [],
                strict=True,
            )
        )
        for error in sent.values():
            if error is None:
                self._refused.pop(publisher, None)
            elif failure_kind(error) == FailureKind.CONFIGURATION:
                self._refused[publisher] = (time.monotonic() + REFUSED_ROUTE_SECONDS, error)
        return [sent.get(event.pk, refusal) for event in group]


def send(publisher: Publisher, group: list[OutboxEvent]) -> list[BaseException | None]:
    """One publisher's share of a wave, in a PRODUCER span; an outcome per event."""
    messages = [OutboxMessage.from_event(event) for event in group]
    with tracing.producer_span(
        SEND_SPAN,
        [message.traceparent for message in messages],
        attributes=_send_attributes(publisher, messages),
    ) as span:
        results = _publish_many(publisher, messages)
        if span is not None:
            failures = [error for error in results if error is not None]
            span.set_attribute("outbox.failed", len(failures))
            if failures:
                tracing.set_error(span, describe(failures[0]))
    return results


def _publish_many(
    publisher: Publisher, messages: list[OutboxMessage]
) -> list[BaseException | None]:
    try:
        results = list(publisher.publish_many(messages))
    except Exception as exc:
        return [exc] * len(messages)
    if len(results) != len(messages):
        error = OutboxError(f"{type(publisher).__name__}.publish_many returned a wrong count")
        return [error] * len(messages)
    return results


def _send_attributes(
    publisher: Publisher, messages: list[OutboxMessage]
) -> dict[str, tracing.AttributeValue]:
    attributes: dict[str, tracing.AttributeValue] = {
        "messaging.operation.type": "send",
        "messaging.batch.message_count": len(messages),
        "outbox.publisher": type(publisher).__name__,
    }
    topics = {message.topic for message in messages}
    if len(topics) == 1:
        attributes["messaging.destination.name"] = topics.pop()
    return attributes
