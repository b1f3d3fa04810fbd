"""SQL that only PostgreSQL speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "NOW",
    "HOLD_OWNER_LOCK",
    "LET_GO_OF_OWNER_LOCK",
    "OUTBOX_KEY_LOCK_CLASS",
    "OWNER_GONE",
    "OWNER_LOCK_CLASS",
    "with_owner_lock_released",
    "before_outbox_insert",
    "begin_outbox_claim",
    "claim_statement",
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
#: gone. Taking the lock to test it, the statement gives it straight back.
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
    table: str, column: Callable[[str], str], names: Sequence[str], *, owner_lock: bool = False
) -> str:
    """The claim as one statement: insert, take over, reuse an expired record, or read it.

    Parameters are named: one per inserted column in ``names`` but the times, which come from
    ``NOW`` plus ``lease_seconds`` and ``expiry_seconds`` (see :func:`_value`), and with
    ``owner_lock``, the lock id. It returns the record's row, whether this request claimed it,
    the database time it judged by, and whether a claim took its owner lock.

    A replay, a ``409`` and a ``422`` only *read*: ``INSERT ... ON CONFLICT DO NOTHING`` leaves an
    existing row alone without locking it, and the UPDATE finds nothing to change, so the
    statement writes nothing, takes no transaction id and flushes no WAL. Only an absent key
    (the INSERT) or an expired or stale record (the UPDATE, whose WHERE PostgreSQL re-checks on
    the row's latest version under its lock) writes, so two claims can never both win. The
    conditions are ``statemachine.is_expired`` and ``Verdict.TAKE_OVER`` written in SQL; a
    property test holds them to the Python rules. If a concurrent claim committed the row after
    this statement's snapshot, nothing comes back and the caller runs another round.
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
    held = HOLD_OWNER_LOCK if owner_lock else "false"
    return (
        f"WITH inserted AS ("
        f"INSERT INTO {table} ({', '.join(column(name) for name in names)}) "
        f"VALUES ({', '.join(_value(name) for name in names)}) "
        f"ON CONFLICT ({column('scope')}, {column('key')}) DO NOTHING "
        f"RETURNING {table}.*, true AS claimed), "
        f"reclaimed AS ("
        f"UPDATE {table} SET {', '.join(assignments)} "
        f"WHERE {key} AND ({expired} OR {stale}) "
        f"RETURNING {table}.*, true AS claimed) "
        f"SELECT *, {NOW} AS database_now, {held} AS owner_lock FROM inserted UNION ALL "
        f"SELECT *, {NOW} AS database_now, {held} AS owner_lock FROM reclaimed UNION ALL "
        f"SELECT {table}.*, false AS claimed, {NOW} AS database_now, false AS owner_lock "
        f"FROM {table} "
        f"WHERE {key} AND NOT EXISTS (SELECT 1 FROM inserted) "
        f"AND NOT EXISTS (SELECT 1 FROM reclaimed)"
    )


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
