"""What every publisher receives and implements."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency.exceptions import BrokerConfigurationError, BrokerUnavailable
from django_idempotency.observability.tracing import TRACEPARENT

__all__ = ["OutboxMessage", "Publisher", "to_json"]

if TYPE_CHECKING:
    from django_idempotency.models import OutboxEvent


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One event as a publisher sees it: no model instance, nothing to save by mistake."""

    event_id: uuid.UUID
    topic: str
    key: str
    payload: Any
    headers: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    #: 1 for the first try; a republish after a failure or a lost lease counts up.
    attempt: int = 1
    #: W3C ``traceparent`` of the span that published the event, if it was traced. Publishers
    #: send it as the message's ``traceparent`` header (see :meth:`trace_headers`).
    traceparent: str | None = None

    @classmethod
    def from_event(cls, event: OutboxEvent) -> OutboxMessage:
        return cls(
            event_id=event.event_id,
            topic=event.topic,
            key=event.key,
            payload=event.payload,
            headers=dict(event.headers or {}),
            created_at=event.created_at,
            attempt=event.attempts + 1,
            traceparent=event.traceparent,
        )

    def trace_headers(self) -> dict[str, str]:
        """``{"traceparent": ...}`` when the event was published in a trace, else empty."""
        return {TRACEPARENT: self.traceparent} if self.traceparent else {}

    def envelope(self) -> dict[str, Any]:
        """The event with its metadata, for transports without message properties (HTTP)."""
        return {
            "event_id": str(self.event_id),
            "topic": self.topic,
            "key": self.key,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "headers": self.headers,
            "payload": self.payload,
        }


def to_json(value: Any) -> bytes:
    """Compact JSON, with the same encoder as the model field (dates, decimals, UUIDs)."""
    return json.dumps(value, cls=DjangoJSONEncoder, separators=(",", ":")).encode()


class Publisher:
    """Base publisher. Subclasses implement :meth:`publish`; batching ones :meth:`publish_many`.

    Options from ``{"BACKEND": ..., "OPTIONS": {...}}`` arrive as keyword arguments. The relay
    builds one instance per route and closes it when it stops, so a publisher may keep a
    connection open between batches.
    """

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(options)}")

    def publish(self, message: OutboxMessage) -> None:
        """Hand one message to the broker; raise on failure (:class:`PublishError` ideally)."""
        raise NotImplementedError

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        """Publish in order; one result per message, ``None`` meaning the broker accepted it.

        :class:`BrokerUnavailable` fails the rest of the batch at once rather than waiting out
        a timeout per message while the relay's lease runs down; so does
        :class:`BrokerConfigurationError`, which the next message would only meet again.
        """
        results: list[BaseException | None] = []
        for index, message in enumerate(messages):
            try:
                self.publish(message)
            except (BrokerUnavailable, BrokerConfigurationError) as exc:
                results.extend([exc] * (len(messages) - index))
                break
            except Exception as exc:
                results.append(exc)
            else:
                results.append(None)
        return results

    def close(self) -> None:
        """Release connections; called when the relay stops."""
