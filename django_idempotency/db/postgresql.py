"""SQL that only PostgreSQL speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "NOW",
    "HOLD_OWNER_LOCK",
    "LET_GO_OF_OWNER_LOCK",
    "OUTBOX_KEY_LOCK_CLASS",
    "RELAY_LOCK_CLASS",
    "RELAYS_GONE",
    "RELAY_SEATS",
    "TAKE_RELAY_SEAT",
    "LEAVE_RELAY_SEAT",
    "KEY_HASH",
    "HOLD_RELAY_LOCK",
    "LET_GO_OF_RELAY_LOCK",
    "OWNER_GONE",
    "OWNER_LOCK_CLASS",
    "with_owner_lock_released",
    "before_outbox_insert",
    "begin_outbox_claim",
    "claim_statement",
    "insert_marker",
    "now_plus",
]

# --- idempotency records -----------------------------------------------------------------------

#: The database's time for this statement. PostgreSQL's ``now()`` is the transaction's start,
#: which inside a long transaction is not "now"; the statement's time is.
NOW = "STATEMENT_TIMESTAMP()"


def now_plus(seconds: float) -> tuple[str, list[Any]]:
    """The statement's time plus ``seconds``, as SQL and its parameters."""
    return f"({NOW} + make_interval(secs => %s))", [float(seconds)]


#: Class id of the owner locks, in the two-integer advisory lock space (apart from the
#: outbox's key locks, and from an application's one-bigint locks).
OWNER_LOCK_CLASS = 1_638_184_609

#: True when no session holds the owner lock ``%(owner_lock)s``: the request that took it is
#: gone. Taking the lock to test it, the statement gives it straight back. A lock the asking
#: session holds itself also passes: one session never serves two requests at once (Django
#: gives each request, async ones included, a thread and so a connection of its own), so the
#: request that took it on this session has ended without letting go.
OWNER_GONE = (
    f"SELECT CASE WHEN pg_try_advisory_lock({OWNER_LOCK_CLASS}, %(owner_lock)s) "
    f"THEN pg_advisory_unlock({OWNER_LOCK_CLASS}, %(owner_lock)s) ELSE false END"
)
HOLD_OWNER_LOCK = f"pg_try_advisory_lock({OWNER_LOCK_CLASS}, %(owner_lock)s)"
LET_GO_OF_OWNER_LOCK = f"pg_advisory_unlock({OWNER_LOCK_CLASS}, %(owner_lock)s)"


def with_owner_lock_released(statement: str) -> str:
    """``statement`` (an UPDATE or DELETE with ``RETURNING 1``, positional parameters) and the
    owner lock's release, in one round trip: one more parameter, the lock id, comes last. The
    result is the number of rows changed and the release's answer.

    A session lock is released at once, even inside the business transaction: a duplicate that
    finds it free before this transaction commits tries a takeover, which waits for this row
    and then finds it completed, so it simply replays.
    """
    return (
        f"WITH changed AS ({statement}) "
        f"SELECT (SELECT count(*) FROM changed), pg_advisory_unlock({OWNER_LOCK_CLASS}, %s)"
    )


def claim_statement(
    table: str,
    column: Callable[[str], str],
    names: Sequence[str],
    *,
    column_types: Mapping[str, str],
    returned: Sequence[str] = (),
    owner_lock: bool = False,
    asynchronous_commit: bool = False,
) -> str:
    """The claim as one statement: insert, take over, reuse an expired record, or read it.

    Parameters are named: one per inserted column in ``names`` but the times, which come from
    ``NOW`` plus ``lease_seconds`` and ``expiry_seconds`` (see :func:`_value`), and with
    ``owner_lock``, the lock id. It returns the record's row, whether this request claimed it,
    the database time it judged by, and whether a claim took its owner lock.

    A replay, a ``409`` and a ``422`` only *read*: the INSERT selects no row when the key exists
    (so not even the id sequence is advanced: a sequence that logs its next values would take a
    transaction id), ``ON CONFLICT DO NOTHING`` covers a row committed since the snapshot without
    locking it, and the UPDATE finds nothing to change, so the statement writes nothing, takes
    no transaction id and flushes no WAL. Only an absent key
    (the INSERT) or an expired or stale record (the UPDATE, whose WHERE PostgreSQL re-checks on
    the row's latest version under its lock) writes, so two claims can never both win. The
    conditions are ``statemachine.is_expired`` and ``Verdict.TAKE_OVER`` written in SQL; a
    property test holds them to the Python rules. If a concurrent claim committed the row after
    this statement's snapshot, nothing comes back and the caller runs another round.

    ``column_types`` gives each inserted column's SQL type: the INSERT's values are a SELECT
    list (so that an existing key selects nothing), whose parameters need casts where VALUES
    would have taken the target columns' types. ``returned`` names the record's columns to
    return (all of them, ``*``, if empty). Named,
    a column added to the table later does not change the statement's result, so a prepared
    statement on a long-lived connection survives a migration.

    With ``asynchronous_commit`` (the statement is its own transaction), a claim that writes
    sets ``synchronous_commit`` off for that transaction, so its commit does not wait for the
    WAL flush. That loses nothing: the business transaction that completes the record commits
    synchronously, which flushes the WAL up to its own commit and so the claim's records before
    it; a claim lost in a crash before that guarded no effect, and its retry claims afresh.
    """

    def col(name: str) -> str:
        return f"{table}.{column(name)}"

    lease_running = (
        f"({col('status')} = 'PROCESSING' AND {col('lease_expires_at')} IS NOT NULL "
        f"AND {col('lease_expires_at')} > {NOW})"
    )
    expired = f"({col('expires_at')} <= {NOW} AND NOT {lease_running})"
    stale = (
        f"({col('status')} = 'PROCESSING' AND NOT {lease_running} "
        f"AND {col('fingerprint')} = %(fingerprint)s)"
    )
    updated = [name for name in names if name not in ("scope", "key", "attempts", "created_at")]
    assignments = [f"{column(name)} = {_value(name)}" for name in updated]
    # A takeover continues the same logical request: its attempt count and first claim time
    # carry over. An expired record is a new request that happens to reuse the row.
    assignments.append(
        f"{column('attempts')} = CASE WHEN {expired} THEN 1 ELSE {col('attempts')} + 1 END"
    )
    assignments.append(
        f"{column('created_at')} = CASE WHEN {expired} THEN {NOW} ELSE {col('created_at')} END"
    )
    key = f"{col('scope')} = %(scope)s AND {col('key')} = %(key)s"
    row = ", ".join(f"{table}.{name}" for name in returned) if returned else f"{table}.*"
    held = HOLD_OWNER_LOCK if owner_lock else "false"
    # Evaluated only for a row the claim wrote: a read-only answer commits nothing anyway.
    claimed = (
        "set_config('synchronous_commit', 'off', true) IS NOT NULL"
        if asynchronous_commit
        else "true"
    )
    return (
        f"WITH inserted AS ("
        f"INSERT INTO {table} ({', '.join(column(name) for name in names)}) "
        f"SELECT {', '.join(_cast(_value(name), column_types[name]) for name in names)} "
        f"WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE {key}) "
        f"ON CONFLICT ({column('scope')}, {column('key')}) DO NOTHING "
        f"RETURNING {row}, {claimed} AS claimed), "
        f"reclaimed AS ("
        f"UPDATE {table} SET {', '.join(assignments)} "
        f"WHERE {key} AND ({expired} OR {stale}) "
        f"RETURNING {row}, {claimed} AS claimed) "
        f"SELECT *, {NOW} AS database_now, {held} AS owner_lock FROM inserted UNION ALL "
        f"SELECT *, {NOW} AS database_now, {held} AS owner_lock FROM reclaimed UNION ALL "
        f"SELECT {row}, false AS claimed, {NOW} AS database_now, false AS owner_lock "
        f"FROM {table} "
        f"WHERE {key} AND NOT EXISTS (SELECT 1 FROM inserted) "
        f"AND NOT EXISTS (SELECT 1 FROM reclaimed)"
    )


def _cast(value: str, sql_type: str) -> str:
    return value if value.startswith("(") or value == NOW else f"CAST({value} AS {sql_type})"


def _value(name: str) -> str:
    """The named placeholder of a column's value; times are the database's own."""
    if name == "created_at":
        return NOW
    if name == "lease_expires_at":
        return f"({NOW} + make_interval(secs => %(lease_seconds)s))"
    if name == "expires_at":
        return f"({NOW} + make_interval(secs => %(expiry_seconds)s))"
    return f"%({name})s"


# --- outbox ------------------------------------------------------------------------------------

#: The class id (first ``int4``) of the advisory locks ``publish()`` takes per ordering key. The
#: two-``int4`` form lives apart from the one-``bigint`` form applications usually use, and this
#: class keeps our locks apart from other users of the two-``int4`` form (it is
#: ``crc32("django_idempotency.outbox") & 0x7fffffff``).
OUTBOX_KEY_LOCK_CLASS = 1_638_184_608

#: Class id of the relay locks: a relay holds one per claimed batch, from the claim to the ack,
#: so another relay can tell a batch whose relay is gone from one still being published.
RELAY_LOCK_CLASS = 1_638_184_610
HOLD_RELAY_LOCK = f"SELECT pg_try_advisory_lock({RELAY_LOCK_CLASS}, %s)"
LET_GO_OF_RELAY_LOCK = f"SELECT pg_advisory_unlock({RELAY_LOCK_CLASS}, %s)"
#: Of the relay lock ids ``%s`` (an array), those no session holds: each is taken to test it
#: and given straight back, all in one round trip. Advisory locks are reentrant, so a lock this
#: very session holds would pass the test: ``pg_locks`` rules those out.
RELAYS_GONE = (
    "SELECT lock_id FROM unnest(%s::int4[]) AS lock_id WHERE NOT EXISTS ("
    "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
    f"AND classid = {RELAY_LOCK_CLASS}::oid AND objid = lock_id::oid AND objsubid = 2) AND CASE "
    f"WHEN pg_try_advisory_lock({RELAY_LOCK_CLASS}, lock_id) "
    f"THEN pg_advisory_unlock({RELAY_LOCK_CLASS}, lock_id) ELSE false END"
)


#: Relay seats: each running relay holds one session lock of this class, ``objid`` its seat
#: number, so the relays can count themselves and each knows its rank among them.
RELAY_SEAT_CLASS = 1_638_184_611
#: The seats held in this database: each one's number, its session, and whether that session is
#: this one. An advisory lock belongs to its database, but ``pg_locks`` shows the whole server's:
#: without the ``database`` condition, the relays of every database on the server would count as
#: one fleet (and each would take only its share of the keys of its own outbox).
RELAY_SEATS = (
    "SELECT objid::int4, pid, pid = pg_backend_pid() FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    f"AND classid = {RELAY_SEAT_CLASS}::oid AND objsubid = 2 AND granted ORDER BY objid"
)
TAKE_RELAY_SEAT = f"SELECT pg_try_advisory_lock({RELAY_SEAT_CLASS}, %s)"
LEAVE_RELAY_SEAT = f"SELECT pg_advisory_unlock({RELAY_SEAT_CLASS}, %s)"
#: A stable integer hash of an event key, for sharing keys between relays.
KEY_HASH = "hashtext"


def before_outbox_insert(
    connection: BaseDatabaseWrapper, *, lock_key: str | None, notify_channel: str | None
) -> None:
    """What ``publish()`` does before its INSERT, in one round trip (none if there is nothing).

    ``lock_key``: take the key's transaction-scoped advisory lock, so a second transaction that
    publishes the same key waits here until this one commits or rolls back, and draws its event
    id from the sequence only then: same-key ids are in commit order. ``hashtext`` collisions
    only make two keys take turns needlessly. Rolling back to a savepoint taken before the lock
    releases it.

    ``notify_channel``: ``NOTIFY`` it, which PostgreSQL delivers at commit and drops on rollback,
    so listening relays wake only for committed events.
    """
    calls: list[str] = []
    params: list[int | str] = []
    if lock_key:
        calls.append("pg_advisory_xact_lock(%s, hashtext(%s::text))")
        params += [OUTBOX_KEY_LOCK_CLASS, lock_key]
    if notify_channel:
        calls.append("pg_notify(%s, '')")
        params.append(notify_channel)
    if calls:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {', '.join(calls)}", params)


def begin_outbox_claim(connection: BaseDatabaseWrapper) -> datetime:
    """Pin the relay claim's plan for its transaction and return the database's time.

    The outbox is a queue, so its statistics are usually stale, and a planner that misjudges
    them fetches every pending row, runs the per-key subquery on each and sorts them all;
    without sorting it walks the relay index in order and stops after one batch. JIT would take
    far longer to compile the plan than the plan takes to run. ``set_config(..., true)`` lasts
    until the transaction ends.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('enable_sort', 'off', true), set_config('jit', 'off', true), "
            "statement_timestamp()"
        )
        row = cursor.fetchone()
    now: datetime = row[2]
    return now


# --- inbox -------------------------------------------------------------------------------------

#: Whether :func:`insert_marker` also deletes the message's failure record.
MARKER_CLEARS_FAILURE = True


def insert_marker(marker: str, failed: str, consumer: str, message_id: str, at: str) -> str:
    """Insert the inbox marker unless it exists, and with it delete the message's failure record.

    One statement with no savepoint (a duplicate is not an error here), where the portable form
    takes four: SAVEPOINT, INSERT, RELEASE, and a DELETE at the end. Its one row, or none, says
    whether the marker is new.
    """
    key = f"{consumer} = %(consumer)s AND {message_id} = %(message_id)s"
    return (
        f"WITH inserted AS ("
        f"INSERT INTO {marker} ({consumer}, {message_id}, {at}) "
        f"VALUES (%(consumer)s, %(message_id)s, %(at)s) "
        f"ON CONFLICT ({consumer}, {message_id}) DO NOTHING RETURNING 1"
        f"), cleared AS ("
        f"DELETE FROM {failed} WHERE {key} AND EXISTS (SELECT 1 FROM inserted)"
        f") SELECT 1 FROM inserted"
    )
