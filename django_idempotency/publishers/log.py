"""Writes each event to the log instead of a broker: for development, or a dry run."""

from __future__ import annotations

import logging
from typing import Any

from django_idempotency.publishers.base import OutboxMessage, Publisher

__all__ = ["LoggingPublisher"]

logger = logging.getLogger(__name__)


class LoggingPublisher(Publisher):
    def __init__(self, *, level: int | str = logging.INFO, **options: Any) -> None:
        super().__init__(**options)
        self.level = logging.getLevelName(level) if isinstance(level, str) else level

    def publish(self, message: OutboxMessage) -> None:
        logger.log(
            self.level,
            "outbox event %s %s",
            message.topic,
            message.event_id,
            extra={
                "outbox_event_id": str(message.event_id),
                "outbox_topic": message.topic,
                "outbox_key": message.key,
                "outbox_attempt": message.attempt,
                "outbox_payload": message.payload,
                "outbox_traceparent": message.traceparent,
            },
        )
