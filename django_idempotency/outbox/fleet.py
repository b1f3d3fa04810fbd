"""Relays side by side, on databases with session locks (PostgreSQL, MariaDB, MySQL).

A relay that runs for good holds a seat, so the relays know how many they are and share the keys
instead of queueing on each other's (see db/session_locks.py). Each claimed batch holds a session
lock, and between batches a relay releases the batches at the head of the outbox whose lock
nobody holds: their relay is gone, and its events go out again without waiting for its lease.
"""

from __future__ import annotations

import contextlib
import logging
import time

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.db import session_locks
from django_idempotency.db.querysets import OutboxEventQuerySet, OutboxStatus

__all__ = ["GoneRelays", "Seating"]

logger = logging.getLogger(__name__)

#: How often (seconds) a relay looks at its seat, and for batches held by relays that are gone.
_LOOK_SECONDS = 1.0
#: How many events at the head of the outbox that look covers: a gone relay's batch sinks to the
#: head as the live relays publish what follows it.
_HEAD_OF_OUTBOX = 1000


class Seating:
    """A relay's seat among the relays, looked at once a second, and the connection of its own
    that holds it (the seat lasts as long as that session)."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.seat: session_locks.Seat | None = None
        self.next_look = 0.0
        self._connection: BaseDatabaseWrapper | None = None

    def look(self) -> None:
        """Hold a seat, and learn how many relays there are (at most once a second)."""
        if not session_locks.enabled(self.using):
            return
        if time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + _LOOK_SECONDS
        if self._connection is None:
            self._connection = session_locks.seat_connection(self.using)
        try:
            self.seat = session_locks.take_seat(self._connection)
        except DatabaseError:
            self.leave()  # a new connection, and a seat on it, at the next look
            raise

    def leave(self) -> None:
        connection, self._connection, self.seat = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(DatabaseError):
                connection.close()  # the session ends, and its seat with it


class GoneRelays:
    """Finds the batches of relays that are gone, at most once a second."""

    def __init__(self, using: str) -> None:
        self.using = using
        self._next_look = 0.0

    def release(self, outbox: OutboxEventQuerySet) -> int:
        """Release the leases, at the head of ``outbox``, of batches whose relay is gone; how
        many events were released."""
        if not session_locks.enabled(self.using):
            return 0
        if time.monotonic() < self._next_look:
            return 0
        self._next_look = time.monotonic() + _LOOK_SECONDS
        head = outbox.filter(status=OutboxStatus.PENDING).in_relay_order()
        tokens = {
            token
            for token in head.values_list("relay_token", flat=True)[:_HEAD_OF_OUTBOX]
            if token is not None
        }
        gone = session_locks.batches_gone(self.using, tokens)
        if not gone:
            return 0
        released = outbox.filter(relay_token__in=gone, status=OutboxStatus.PENDING).update(
            locked_until=None, relay_token=None
        )
        if released:
            logger.warning(
                "outbox relay released %d events leased by %d relays that are gone",
                released,
                len(gone),
                extra={"outbox_reclaimed": released},
            )
        return released
