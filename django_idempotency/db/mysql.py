"""SQL that only MariaDB and MySQL speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "HOLD_OWNER_LOCK",
    "LET_GO_OF_OWNER_LOCK",
    "OWNER_GONE",
    "insert_marker",
    "KEY_HASH",
    "relay_seats",
    "relays_gone",
    "TAKE_RELAY_SEAT",
    "NOW",
    "lock_outbox_key",
    "now_plus",
]

# --- idempotency records -----------------------------------------------------------------------

#: The database's time in UTC, as Django stores datetimes here. ``CURRENT_TIMESTAMP`` (what
#: Django's ``Now()`` uses) is in the session's time zone, which need not be UTC.
NOW = "UTC_TIMESTAMP(6)"


def now_plus(seconds: float) -> tuple[str, list[Any]]:
    """The database's time plus ``seconds``, as SQL and its parameters."""
    return f"({NOW} + INTERVAL %s MICROSECOND)", [round(seconds * 1_000_000)]


#: Owner locks are named session locks (``GET_LOCK``), one per claim: a duplicate that finds the
#: name free knows the connection of the request holding the key is gone.
HOLD_OWNER_LOCK = "SELECT GET_LOCK(%s, 0)"
OWNER_GONE = "SELECT IS_FREE_LOCK(%s)"
LET_GO_OF_OWNER_LOCK = "SELECT RELEASE_LOCK(%s)"


def relays_gone(count: int) -> str:
    """One row telling, for each of ``count`` relay lock names, whether no session holds it."""
    return "SELECT " + ", ".join(["IS_FREE_LOCK(%s)"] * count)


#: A relay seat's lock name, its number the parameter. ``GET_LOCK`` names are the server's, not
#: the database's: the name carries the database (a digest, for names are at most 64
#: characters), so relays of other databases on the same server are not counted in the fleet.
_SEAT_NAME = "CONCAT('outbox-relay-seat:', MD5(DATABASE()), ':', %s)"
#: Take seat ``%s`` if it is free: 1 when taken, 0 when another session holds it.
TAKE_RELAY_SEAT = f"SELECT GET_LOCK({_SEAT_NAME}, 0)"


def relay_seats(count: int) -> str:
    """One row: the connection holding each of seats ``0 .. count - 1``, each its number as a
    parameter (NULL: free), then this session's connection id."""
    return "SELECT " + ", ".join([f"IS_USED_LOCK({_SEAT_NAME})"] * count) + ", CONNECTION_ID()"


#: A sweep's session lock, the sweep's name the parameter; the name carries the database, as the
#: relay seats' do. A sweep that finds it held skips its run.
_SWEEP_LOCK_NAME = "CONCAT('idempotency-sweep:', MD5(DATABASE()), ':', %s)"
HOLD_SWEEP_LOCK = f"SELECT GET_LOCK({_SWEEP_LOCK_NAME}, 0)"
LET_GO_OF_SWEEP_LOCK = f"SELECT RELEASE_LOCK({_SWEEP_LOCK_NAME})"


#: A stable integer hash of an event key, for sharing keys between relays.
KEY_HASH = "CRC32"


# --- outbox ------------------------------------------------------------------------------------


def lock_outbox_key(connection: BaseDatabaseWrapper, table: str, bucket: int) -> None:
    """Lock the row of ``bucket`` in ``table`` (``OutboxKeyLock``) until the transaction ends.

    MariaDB and MySQL have no transaction-scoped advisory lock (``GET_LOCK`` belongs to the
    session and outlives a rollback), so a same-key publisher locks a row instead, before its
    INSERT: a second transaction publishing a key of the same bucket waits here until this one
    commits or rolls back, and only then takes its ``AUTO_INCREMENT`` id, so same-key ids are
    in commit order. ``INSERT ... ON DUPLICATE KEY UPDATE`` takes the exclusive lock in one
    statement whether the row exists or not (a first-time insert holds its new row's lock; a
    duplicate takes an exclusive lock on the existing row), at any isolation level. INSERT
    IGNORE followed by SELECT ... FOR UPDATE would not do: two transactions would share the
    duplicate row's shared lock and then deadlock upgrading it. Rolling back to a savepoint taken
    before this releases the lock.
    """
    quoted = connection.ops.quote_name(table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quoted} (bucket) VALUES (%s) ON DUPLICATE KEY UPDATE bucket = bucket",
            [bucket],
        )


# --- inbox -------------------------------------------------------------------------------------

#: Whether :func:`insert_marker` also deletes the message's failure record (it does not: a
#: DELETE that finds no row would hold a gap lock for the whole handler).
MARKER_CLEARS_FAILURE = False


def insert_marker(marker: str, failed: str, consumer: str, message_id: str, at: str) -> str:
    """Insert the inbox marker unless it exists; one row affected when it is new.

    ``IGNORE`` also downgrades other errors to warnings; the values are checked before (text of
    at most 255 characters, an aware datetime), so only the duplicate is left for it to ignore.
    """
    return (
        f"INSERT IGNORE INTO {marker} ({consumer}, {message_id}, {at}) "
        f"VALUES (%(consumer)s, %(message_id)s, %(at)s)"
    )
