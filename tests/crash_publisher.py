"""A relay process that dies between publishing and acknowledging (see test_outbox_e2e.py).

``outbox_relay`` run with ``tests.settings_relay_crash`` publishes through this publisher, which
hands the batch to RabbitMQ, writes ``marker`` so the test knows, then hangs until killed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from django_idempotency.publishers.amqp import AMQPPublisher
from django_idempotency.publishers.base import OutboxMessage


class PublishThenHang(AMQPPublisher):
    def __init__(self, *, marker: str, **options: Any) -> None:
        super().__init__(**options)
        self.marker = Path(marker)

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results = super().publish_many(messages)
        self.marker.write_text(repr(results))
        time.sleep(3600)
        return results
