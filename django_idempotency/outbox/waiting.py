"""Waiting between a relay's passes: woken by a publishing commit where the database can say so,
else polling, so a relay sees a new event within milliseconds and an idle one costs little.

An acknowledgement wakes the others too (``outbox.ack``): a relay that found only heads another
relay held waits on that relay's ack, not on its poll.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from django_idempotency.conf import conf
from django_idempotency.outbox.publish import NOTIFY_CHANNEL

__all__ = ["Wait", "waiter"]

logger = logging.getLogger(__name__)

#: A polling relay's wait after a pass that found events; it doubles while passes find none.
_FIRST_POLL_SECONDS = 0.05

#: ``wait(timeout, stop, busy)``: sleep until the next pass; ``busy``: the last pass found events.
Wait = Callable[[float, threading.Event, bool], None]


class waiter:  # noqa: N801  (used as a context manager, like contextlib's)
    """Sleep until the next pass: on PostgreSQL with psycopg 3, LISTEN on a connection of its
    own and wake at the first NOTIFY from a publishing commit; elsewhere, just the poll.

    A LISTEN connection that breaks (a database restart) is made again at the next wait that
    finds the database answering, and that wait returns at once: commits made while nobody
    listened sent their NOTIFY to no one, so a pass looks for their events.

    Polling (no LISTEN) backs off: after a pass that found events the next comes 50 ms later,
    and each pass that finds nothing doubles the wait, up to the poll, so a relay that has just
    been busy sees the next commit within tens of milliseconds and an idle one costs little."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.listener: Any = None
        self.wanted = False
        self.idle_wait = _FIRST_POLL_SECONDS

    def __enter__(self) -> Wait:
        connection = connections[self.using]
        if conf.OUTBOX_NOTIFY and connection.vendor == "postgresql":
            self.wanted = True
            try:
                self.listener = self._listen()
            except Exception:
                logger.warning("outbox relay cannot LISTEN; polling instead", exc_info=True)
        return self.wait

    def _listen(self) -> Any:
        connection = connections[self.using]
        raw = connection.get_new_connection(connection.get_connection_params())
        if not hasattr(raw, "notifies"):  # psycopg2: no blocking notifies() API; poll instead
            self.wanted = False
            raw.close()
            return None
        raw.autocommit = True
        raw.execute(f"LISTEN {NOTIFY_CHANNEL}")
        return raw

    def wait(self, timeout: float, stop: threading.Event, busy: bool = False) -> None:
        if self.listener is None and self.wanted:
            try:
                self.listener = self._listen()
            except Exception:
                logger.debug("outbox relay cannot LISTEN yet", exc_info=True)
            else:
                if self.listener is not None:
                    logger.warning("outbox relay is listening for commits again")
                    return
        if self.listener is None:
            if busy:
                self.idle_wait = _FIRST_POLL_SECONDS
            stop.wait(min(timeout, self.idle_wait))
            self.idle_wait = min(timeout, self.idle_wait * 2)
            return
        deadline = time.monotonic() + timeout
        try:
            # Short slices so a set ``stop`` is noticed within a second.
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                for _ in self.listener.notifies(timeout=min(left, 1.0), stop_after=1):
                    return
        except Exception:
            logger.warning(
                "outbox relay lost its LISTEN connection; polling until it is back",
                exc_info=True,
            )
            self._close()

    def _close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            with contextlib.suppress(Exception):  # already broken
                listener.close()

    def __exit__(self, *exc: object) -> None:
        self.wanted = False
        self._close()
