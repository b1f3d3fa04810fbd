"""An in-memory broker for tests: records what the relay published, and can fail on demand."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django_idempotency.exceptions import PublishError
from django_idempotency.publishers.base import OutboxMessage, Publisher


class MemoryBroker:
    """Process-wide store shared by every :class:`MemoryPublisher` (the relay builds new ones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: list[OutboxMessage] = []
        self._fail_when: Callable[[OutboxMessage], bool] | None = None

    def fail_when(self, predicate: Callable[[OutboxMessage], bool] | None) -> None:
        """Make publishing raise :class:`PublishError` for messages ``predicate`` picks."""
        self._fail_when = predicate

    def clear(self) -> None:
        with self._lock:
            self.messages.clear()
        self._fail_when = None

    def receive(self, message: OutboxMessage) -> None:
        predicate = self._fail_when
        if predicate is not None and predicate(message):
            raise PublishError(f"injected failure for {message.event_id}")
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
