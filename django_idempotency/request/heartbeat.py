"""The lease heartbeat: keeps a slow view's key from being taken over while it still runs."""

from __future__ import annotations

import threading

from django.db import InterfaceError, OperationalError, connections

from django_idempotency.conf import conf
from django_idempotency.core.types import Lease
from django_idempotency.request import instrumentation, store

__all__ = ["LeaseHeartbeat"]


class LeaseHeartbeat:
    """Extends a lease from a background thread while a long view runs.

    The thread has its own database connection (Django's are per thread), so its updates commit
    at once instead of waiting in the view's transaction.
    """

    def __init__(self, lease: Lease, interval: float | None = None) -> None:
        self.lease = lease
        length = conf.LEASE_SECONDS if lease.lease_seconds is None else lease.lease_seconds
        self.interval = interval if interval is not None else max(length / 3, 0.05)
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="idempotency-heartbeat", daemon=True
        )

    def __enter__(self) -> LeaseHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join()

    def _beat(self) -> None:
        connection = connections[self.lease.using]
        try:
            while not self._stopped.wait(self.interval):
                try:
                    if not store.extend(self.lease):
                        return
                except (OperationalError, InterfaceError) as exc:
                    instrumentation.store_unavailable(
                        self.lease.identity, "idempotency heartbeat failed", exc
                    )
        finally:
            connection.close()
