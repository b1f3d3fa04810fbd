"""Keep a batch's lease while the batch is published, so the lease can be short.

The lease only matters for a relay that is alive but cannot reach the database, or that is gone
on a backend without session locks; a slow batch must not lose it. A thread renews it a third of
the lease at a time, by the database's clock.
"""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta

from django.db import DatabaseError, connections

from django_idempotency.db.querysets import OutboxEventQuerySet, OutboxStatus
from django_idempotency.outbox.clock import DatabaseClock

__all__ = ["LeaseRenewal"]

logger = logging.getLogger(__name__)


class LeaseRenewal:
    """Renews a batch's lease from a thread while the batch is published. The thread has its own
    connection (Django's are per thread); its updates are fenced on the batch's token, so a
    batch that was taken over is left alone. Nothing is renewed while the relay runs inside an
    outer transaction (tests): its claim is not visible to another connection then."""

    def __init__(
        self,
        outbox: OutboxEventQuerySet,
        lease_seconds: float,
        token: uuid.UUID | None,
        clock: DatabaseClock,
    ) -> None:
        self.outbox, self.lease_seconds = outbox, lease_seconds
        self.token, self.clock = token, clock
        self.interval = lease_seconds / 3
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LeaseRenewal:
        if self.token is not None and not connections[self.outbox.db].in_atomic_block:
            self._thread = threading.Thread(
                target=self._renew, name="outbox-lease-renewal", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _renew(self) -> None:
        try:
            while not self._stopped.wait(self.interval):
                until = self.clock.now() + timedelta(seconds=self.lease_seconds)
                try:
                    renewed = self.outbox.filter(
                        relay_token=self.token, status=OutboxStatus.PENDING
                    ).update(locked_until=until)
                except DatabaseError:
                    logger.warning("outbox relay could not renew its lease", exc_info=True)
                    continue
                if not renewed:
                    return
        finally:
            connections[self.outbox.db].close()
