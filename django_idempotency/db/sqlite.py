"""SQL that only SQLite speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOW", "insert_marker", "now_plus"]

# --- idempotency records -----------------------------------------------------------------------

#: The database's time in UTC, in the text form Django stores (milliseconds: SQLite's clock
#: has no finer grain). The percent signs are doubled for the driver's parameter syntax.
NOW = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"


def now_plus(seconds: float) -> tuple[str, list[Any]]:
    """The database's time plus ``seconds``, as SQL and its parameters."""
    return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)", [f"{seconds:+.6f} seconds"]


# --- outbox ------------------------------------------------------------------------------------

# Same-key publishers need no lock of their own here. A transaction that writes holds the
# database's one write lock from its first write (from BEGIN with ``transaction_mode``
# IMMEDIATE) until it ends, so no other transaction can insert an outbox event between a
# publish's INSERT and its commit: event ids, keyed or not, are in commit order.
# (tests/outbox/test_order.py shows a second writer refused while the first is open.)
#
# Nor does the relay read the time from SQLite: a SQLite database is only ever opened by the
# processes of one machine, whose clock is the database's, and Python reads that clock to the
# microsecond where SQLite's own ``'now'`` has milliseconds.


# --- inbox -------------------------------------------------------------------------------------

#: Whether :func:`insert_marker` also deletes the message's failure record.
MARKER_CLEARS_FAILURE = False


def insert_marker(marker: str, failed: str, consumer: str, message_id: str, at: str) -> str:
    """Insert the inbox marker unless it exists; one row affected when it is new."""
    return (
        f"INSERT INTO {marker} ({consumer}, {message_id}, {at}) "
        f"VALUES (%(consumer)s, %(message_id)s, %(at)s) "
        f"ON CONFLICT ({consumer}, {message_id}) DO NOTHING"
    )
