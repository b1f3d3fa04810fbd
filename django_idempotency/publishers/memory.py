"""An in-memory broker for tests: records what the relay published, and can fail on demand."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django_idempotency.exceptions import PublishError
from django_idempotency.publishers.base import OutboxMessage, Publisher

__all__ = ["MemoryBroker", "MemoryPublisher", "broker"]


class MemoryBroker:
    """Process-wide store shared by every :class:`MemoryPublisher` (the relay builds new ones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: list[OutboxMessage] = []
        self._fail_when: Callable[[OutboxMessage], bool] | None = None
        self._failure: type[PublishError] = PublishError

    def fail_when(
        self,
        predicate: Callable[[OutboxMessage], bool] | None,
        failure: type[PublishError] = PublishError,
    ) -> None:
        """Make publishing raise ``failure`` for messages ``predicate`` picks.

        Pass :class:`~django_idempotency.exceptions.BrokerUnavailable` to play a broker outage.
        """
        self._fail_when = predicate
        self._failure = failure

    def clear(self) -> None:
        with self._lock:
            self.messages.clear()
        self._fail_when = None
        self._failure = PublishError

    def receive(self, message: OutboxMessage) -> None:
        predicate = self._fail_when
        if predicate is not None and predicate(message):
            raise self._failure(f"injected failure for {message.event_id}")
        with self._lock:
            self.messages.append(message)

    def snapshot(self) -> list[OutboxMessage]:
        with self._lock:
            return list(self.messages)


#: The broker every MemoryPublisher writes to.
broker = MemoryBroker()


class MemoryPublisher(Publisher):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)

    def publish(self, message: OutboxMessage) -> None:
        broker.receive(message)
