"""What a consumer is handling now, and the ids of the events it publishes meanwhile.

Below both the outbox and the inbox: ``publish()`` asks :func:`derived_event_id` for the id of
an event published while a message is handled, and ``consume_once`` sets :data:`current`.
Derived ids are the same on every re-run of a handler, so a redelivered message publishes the
same events and the outbox's unique id drops the copies.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["DERIVED_ID_NAMESPACE", "Consumption", "current", "derived_event_id"]

#: Namespace of the event ids derived from a consumed message (uuid5).
DERIVED_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:django-idempotency:derived-event")


@dataclass(slots=True)
class Consumption:
    """One message being handled; false when it is a duplicate to skip::

    with consume_once("billing", message.id) as consumption:
        if not consumption:
            return
        ...
    """

    consumer: str
    message_id: str
    duplicate: bool
    _sequence: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def __bool__(self) -> bool:
        return not self.duplicate

    def next_event_id(self) -> uuid.UUID:
        """The id of the next event this handler publishes: the same on every re-run."""
        name = f"{self.consumer}\x00{self.message_id}\x00{next(self._sequence)}"
        return uuid.uuid5(DERIVED_ID_NAMESPACE, name)


current: ContextVar[Consumption | None] = ContextVar("django_idempotency_consumption", default=None)


def derived_event_id() -> uuid.UUID | None:
    """The next derived event id when a message is being handled, else None."""
    consumption = current.get()
    return consumption.next_event_id() if consumption is not None else None
