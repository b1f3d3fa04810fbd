"""SQL that only MariaDB and MySQL speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from typing import Any

# --- idempotency records -----------------------------------------------------------------------

#: The database's time in UTC, as Django stores datetimes here. ``CURRENT_TIMESTAMP`` (what
#: Django's ``Now()`` uses) is in the session's time zone, which need not be UTC.
NOW = "UTC_TIMESTAMP(6)"


def now_plus(seconds: float) -> tuple[str, list[Any]]:
    """The database's time plus ``seconds``, as SQL and its parameters."""
    return f"({NOW} + INTERVAL %s MICROSECOND)", [round(seconds * 1_000_000)]


# --- outbox ------------------------------------------------------------------------------------
