"""Shared helpers for the outbox and consumer tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection, connections, transaction

from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from django_idempotency.publishers.memory import broker


def publish_committed(
    topic: str = "orders.paid", payload: Any = None, **kwargs: Any
) -> OutboxEvent:
    with transaction.atomic():
        return publish(topic, {"n": 1} if payload is None else payload, **kwargs)


def published_ids() -> list[str]:
    return [str(message.event_id) for message in broker.snapshot()]


def is_postgresql() -> bool:
    return connection.vendor == "postgresql"


class HeldTransaction:
    """Runs ``work`` in a transaction on another thread and keeps it open until ``release()``."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.started = threading.Event()
        self._release = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with transaction.atomic():
                self.result = self.work()
                self.started.set()
                self._release.wait(60)
        except BaseException as exc:
            self.error = exc
            self.started.set()
        finally:
            connections.close_all()

    def __enter__(self) -> HeldTransaction:
        self._thread.start()
        assert self.started.wait(30), "the held transaction did not start"
        assert self.error is None, self.error
        return self

    def release(self) -> None:
        self._release.set()
        self._thread.join(30)
        assert self.error is None, self.error

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self.release()
