"""Publishers for relays in other processes that a test breaks (see tests/outbox/test_e2e.py).

``PublishThenHang`` (with ``tests.support.settings_relay_crash``) hands the batch to RabbitMQ,
writes ``marker`` so the test knows, then hangs until killed. ``FilePublisher`` and
``CutOffAfterPublish`` (with ``tests.support.settings_relay_file``) write what they send to a file.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from django_idempotency.publishers.amqp import AMQPPublisher
from django_idempotency.publishers.base import OutboxMessage, Publisher


class PublishThenHang(AMQPPublisher):
    def __init__(self, *, marker: str, **options: Any) -> None:
        super().__init__(**options)
        self.marker = Path(marker)

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results = super().publish_many(messages)
        self.marker.write_text(repr(results))
        time.sleep(3600)
        return results


class FilePublisher(Publisher):
    """Appends each event id to ``path``, one line each, so a test reads back what a relay in
    another process sent, duplicates included. While ``hold_file`` exists, a batch waits after
    sending (published, not yet acknowledged) until the file is gone."""

    def __init__(self, *, path: str, hold_file: str = "", tag: str = "", **options: Any) -> None:
        super().__init__(**options)
        self.path = Path(path)
        self.hold_file = Path(hold_file) if hold_file else None
        #: Written before each id (``"<tag> <id>"``), to tell relays apart in one shared file.
        self.prefix = f"{tag} " if tag else ""

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        # One write per batch (it fits the buffer), appended: relays sharing the file never
        # interleave inside a batch, and the file's order is the order of publishing.
        with self.path.open("a") as sink:
            sink.writelines(f"{self.prefix}{message.event_id}\n" for message in messages)
        while self.hold_file is not None and self.hold_file.exists():
            time.sleep(0.05)
        return [None] * len(messages)


class CutOffAfterPublish(FilePublisher):
    """Sends the first batch, then has the database drop the relay's own connection (as a
    restart would) before the relay can acknowledge it."""

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results = super().publish_many(messages)
        if not self.path.with_suffix(".cut").exists():
            self.path.with_suffix(".cut").touch()
            _drop_this_threads_connection()
        return results


def _drop_this_threads_connection() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        postgresql = connection.vendor == "postgresql"
        cursor.execute("SELECT pg_backend_pid()" if postgresql else "SELECT CONNECTION_ID()")
        (session,) = cursor.fetchone()
    other = connection.get_new_connection(connection.get_connection_params())
    try:
        killer = other.cursor()
        if postgresql:
            killer.execute("SELECT pg_terminate_backend(%s)", [session])
        else:
            killer.execute(f"KILL CONNECTION {int(session)}")
    finally:
        other.close()
