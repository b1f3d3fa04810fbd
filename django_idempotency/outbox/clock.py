"""The database's clock, which every relay shares.

Leases (``locked_until``) and backoffs (``next_attempt_at``) are compared and set by it rather
than by a relay's own wall clock, so relays on machines whose clocks disagree by minutes still
never hold one event at once. A pass reads it once, with its claim, and carries it forward on
the monotonic clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from django_idempotency.db import database_now

__all__ = ["DatabaseClock"]


@dataclass(frozen=True, slots=True)
class DatabaseClock:
    """The database's time, read once and carried forward on this process's monotonic clock.

    The monotonic clock only measures the seconds since the reading, which no clock setting
    moves.
    """

    read_at: datetime
    monotonic: float

    @classmethod
    def read(cls, connection: BaseDatabaseWrapper) -> DatabaseClock:
        """Read the database's time, in a statement of its own. (The claim on PostgreSQL needs
        none: its one statement returns the time with the batch.)"""
        if connection.vendor in ("postgresql", "mysql"):
            now = database_now(connection.alias)
        else:
            # SQLite: the machine's clock is the database's (see db/sqlite.py). Other backends
            # have no statement here yet, and need their relays' clocks to agree.
            now = timezone.now()
        return cls(read_at=now, monotonic=time.monotonic())

    def now(self) -> datetime:
        return self.read_at + timedelta(seconds=time.monotonic() - self.monotonic)
