"""Test helpers for projects using the outbox, idempotent consumers and the sweeps.

The pytest plugin (``pytest_plugin.py``, loaded automatically) wraps these in fixtures; they are
plain functions so unittest-style tests can use them too.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.db import connections, models
from django.db.models import F

from django_idempotency import signals
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.report import RelayStats
from django_idempotency.publishers.base import OutboxMessage
from django_idempotency.publishers.memory import broker

__all__ = [
    "MEMORY_ROUTES",
    "OutboxRecorder",
    "age",
    "assert_publishes",
    "capture_events",
    "deliver_concurrently",
    "deliver_twice",
    "relay_now",
]

#: ``OUTBOX_PUBLISHERS`` that sends every topic to the in-memory broker.
MEMORY_ROUTES = {"*": "django_idempotency.publishers.memory.MemoryPublisher"}


class _FullBackoff(random.Random):
    """Backoffs at their ceiling, never a random part of it: a publish that fails waits its
    whole first backoff (``OUTBOX_BACKOFF_BASE_SECONDS``), so one drain tries each event once.
    With the relay's jitter, a backoff shorter than the drain's own pass was retried in the same
    drain, and a test's count of failures depended on a random draw."""

    def uniform(self, a: float, b: float) -> float:
        return b


def _test_relay(using: str) -> Relay:
    return Relay(using=using, allow_in_transaction=True, rng=_FullBackoff())


def relay_now(using: str) -> None:
    """An ``OUTBOX_KICK`` that relays at once, in this thread, even inside a test transaction."""
    with _test_relay(using) as relay:
        relay.drain()


class OutboxRecorder:
    """What the ``outbox_relay`` fixture yields: the relay to run and what it published."""

    def __init__(self, using: str = "default") -> None:
        self.using = using

    @property
    def messages(self) -> list[OutboxMessage]:
        """Everything published to the in-memory broker, in order."""
        return broker.snapshot()

    def topics(self) -> list[str]:
        return [message.topic for message in self.messages]

    def relay(self) -> RelayStats:
        """Publish everything due now, synchronously: each due event is tried once (a failure
        waits its whole first backoff, not a random part of it)."""
        with _test_relay(self.using) as relay:
            return relay.drain()

    def fail_when(self, predicate: Callable[[OutboxMessage], bool] | None) -> None:
        """Make publishing fail for the messages ``predicate`` picks (None: stop failing)."""
        broker.fail_when(predicate)

    def clear(self) -> None:
        broker.clear()


@contextmanager
def capture_events() -> Iterator[list[OutboxEvent]]:
    """Collect the events ``publish()`` writes inside the block (rolled back or not)."""
    events: list[OutboxEvent] = []

    def record(sender: Any, event: OutboxEvent, **kwargs: Any) -> None:
        events.append(event)

    signals.event_enqueued.connect(record, weak=False)
    try:
        yield events
    finally:
        signals.event_enqueued.disconnect(record)


@contextmanager
def assert_publishes(
    count: int | None = None, *, topic: str | None = None, key: str | None = None
) -> Iterator[list[OutboxEvent]]:
    """Assert the block publishes ``count`` events (at least one when None), optionally only
    those of ``topic`` / ``key``; yields the matching events."""
    matching: list[OutboxEvent] = []
    with capture_events() as events:
        yield matching
    matching.extend(
        event
        for event in events
        if (topic is None or event.topic == topic) and (key is None or event.key == key)
    )
    what = " ".join(filter(None, [topic and f"topic={topic!r}", key and f"key={key!r}"]))
    label = f" ({what})" if what else ""
    if count is None:
        assert matching, f"expected the block to publish events{label}, it published none"
    else:
        assert len(matching) == count, (
            f"expected {count} events{label}, got {len(matching)}: "
            f"{[(event.topic, event.key) for event in events]}"
        )


def _deliver(handler: Any, args: tuple[Any, ...], kwargs: dict[str, Any], task_id: str) -> Any:
    """One delivery: a Celery task runs as the worker would, with ``task_id``; any other
    callable is simply called."""
    apply = getattr(handler, "apply", None)
    if apply is None:
        return handler(*args, **kwargs)
    return apply(args=args, kwargs=kwargs, task_id=task_id, throw=True).get()


def deliver_twice(handler: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Deliver the same message twice in a row (same task id); returns both results."""
    task_id = str(uuid.uuid4())
    return (
        _deliver(handler, args, kwargs, task_id),
        _deliver(handler, args, kwargs, task_id),
    )


def deliver_concurrently(
    handler: Any, *args: Any, times: int = 2, timeout: float = 60, **kwargs: Any
) -> list[Any]:
    """Deliver the same message ``times`` times at once from threads, each with its own
    database connection; returns the results (an exception where a delivery raised).

    Needs a transactional test (``django_db(transaction=True)``): the threads must see each
    other's commits.
    """
    task_id = str(uuid.uuid4())
    start = threading.Barrier(times)
    results: list[Any] = [None] * times

    def run(index: int) -> None:
        try:
            start.wait(timeout)
            results[index] = _deliver(handler, args, kwargs, task_id)
        except BaseException as exc:
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(times)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return results


def age(rows: models.Model | models.QuerySet[Any], by: timedelta) -> int:
    """Make rows ``by`` older: move every date-time column of theirs that long into the past.

    For records, events and markers written now that a test wants the sweeps (or a TTL, or a
    lease) to treat as old: ``age(ProcessedMessage.objects.all(), by=timedelta(days=15))``.
    Every column moves, so the rows stay as consistent as they were (a record's expiry stays
    ``TTL_SECONDS`` after its completion). Takes a queryset or one saved instance (which is not
    refreshed); returns how many rows changed.
    """
    if isinstance(rows, models.Model):
        rows = type(rows)._default_manager.using(rows._state.db).filter(pk=rows.pk)
    columns = [
        field.attname
        for field in rows.model._meta.concrete_fields
        if isinstance(field, models.DateTimeField)
    ]
    if not columns:
        raise TypeError(f"{rows.model.__name__} has no date-time column to make older")
    return rows.update(**{column: F(column) - by for column in columns})
