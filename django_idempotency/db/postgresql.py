"""SQL that only PostgreSQL speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

import datetime
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.core import leases

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
    "KEY_LOCK_STATEMENT",
    "KEY_LOCK_STEP",
    "RECORD_KEY_LOCK_CLASS",
    "claim_function",
    "with_owner_lock_released",
    "before_outbox_insert",
    "ACK_COLUMNS",
    "ACK_FAILED",
    "ACK_SENT",
    "ACK_UNTRIED",
    "CLAIM_CANDIDATE",
    "Fragment",
    "PIN_OUTBOX_CLAIM_PLAN",
    "fetch_outbox_claim",
    "outbox_ack_statement",
    "outbox_claim_statement",
    "claim_statement",
    "insert_marker",
    "now_plus",
    "OUTBOX_AUTOVACUUM",
    "OUTBOX_FILLFACTOR",
    "OUTBOX_STORAGE",
    "alter_outbox_storage",
    "storage_parameters",
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


#: Class id of the per-key locks of a partitioned records table (docs/partitions.md): each claim
#: takes its key's lock, for its transaction, before it looks the key up.
RECORD_KEY_LOCK_CLASS = 1_638_184_612

#: The first step of the partitioned claim (:func:`claim_function`): its key's lock, for the
#: transaction. PostgreSQL cannot enforce ``(scope, key)`` across partitions (a unique index on
#: a partitioned table must include the partition column), so every claim of a key takes this
#: lock first, and the claim's lookup runs as a *later* statement: under READ COMMITTED a
#: statement's snapshot is taken when it starts, so only a statement that starts after the lock
#: is granted sees the row of a claim that committed while this one waited. (A lock taken inside
#: the claim statement itself, in a CTE, would come after that statement's snapshot.) The
#: scope's length goes into the hash so ``("a b", "c")`` and ``("a", "b c")`` hash different
#: texts; a collision of the 32-bit hash only makes two keys take turns, it never merges them.
KEY_LOCK_STEP = (
    f"PERFORM pg_advisory_xact_lock({RECORD_KEY_LOCK_CLASS}, "
    f"hashtext(length(p_scope)::text || ':' || p_scope || p_key));"
)
#: The same lock as a statement of its own (named parameters ``scope`` and ``key``), for a
#: claim inside a caller's transaction on a connection where the function is not there yet.
KEY_LOCK_STATEMENT = (
    f"SELECT pg_advisory_xact_lock({RECORD_KEY_LOCK_CLASS}, "
    f"hashtext(length(%(scope)s)::text || ':' || %(scope)s || %(key)s))"
)


def claim_function(
    name: str,
    statement: str,
    parameters: Sequence[tuple[str, str]],
    returned: Sequence[tuple[str, str]],
    *,
    insert: str,
) -> tuple[str, str]:
    """The partitioned claim as a server-side function: the DDL that creates it, and the
    statement that calls it (named parameters, as ``statement``'s).

    The function takes the key's lock (:data:`KEY_LOCK_STEP`) and then runs ``statement``.
    A ``VOLATILE`` PL/pgSQL function takes a fresh snapshot for each statement it runs, so the
    claim's lookup sees every claim of the key that committed while this one waited for the
    lock: the guarantee of two statements, in one statement the client can prepare, with the
    plans of both cached by the session (a partitioned table costs more to plan than to run).

    ``parameters`` and ``returned`` are (name, SQL type) pairs: the function's arguments, in
    the call's order, and its result columns, which must match ``statement``'s. ``insert``
    runs first: the insert of a new record when the key has none (the same result columns, no
    row otherwise); only when it inserted nothing does ``statement`` run. The first claim of a
    key, the most common, then neither plans nor runs the DELETE and the UPDATE, which on a
    partitioned table cost more than the insert itself.
    """
    placeholder = re.compile(r"%\((\w+)\)s")

    def body(sql: str) -> str:
        return placeholder.sub(lambda match: f"p_{match[1]}", sql)

    arguments = ", ".join(f"p_{arg} {sql_type}" for arg, sql_type in parameters)
    result = ", ".join(f'"{column}" {sql_type}' for column, sql_type in returned)
    ddl = (
        f"CREATE OR REPLACE FUNCTION {name}({arguments}) RETURNS TABLE ({result}) "
        f"LANGUAGE plpgsql VOLATILE AS $claim$\n#variable_conflict use_column\nBEGIN\n"
        f"{KEY_LOCK_STEP}\nRETURN QUERY {body(insert)};\n"
        f"IF NOT FOUND THEN\nRETURN QUERY {body(statement)};\nEND IF;\nEND\n$claim$"
    )
    call = ", ".join(f"CAST(%({arg})s AS {sql_type})" for arg, sql_type in parameters)
    return ddl, f"SELECT * FROM {name}({call})"


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
    literals: Mapping[str, str] | None = None,
    returned: Sequence[str] = (),
    owner_lock: bool = False,
    asynchronous_commit: bool = False,
    partitioned: bool = False,
    insert_only: bool = False,
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
    would have taken the target columns' types. ``literals`` gives the columns every claim
    writes the same value to (a new record's status, its empty response) as SQL literals, which
    need neither a parameter nor a cast. ``returned`` names the record's columns to
    return (all of them, ``*``, if empty). Named,
    a column added to the table later does not change the statement's result, so a prepared
    statement on a long-lived connection survives a migration.

    With ``asynchronous_commit`` (the statement is its own transaction), a claim that writes
    sets ``synchronous_commit`` off for that transaction, so its commit does not wait for the
    WAL flush. That loses nothing: the business transaction that completes the record commits
    synchronously, which flushes the WAL up to its own commit and so the claim's records before
    it; a claim lost in a crash before that guarded no effect, and its retry claims afresh.

    ``partitioned``: the statement for a records table partitioned by ``created_at``, which
    runs after :data:`KEY_LOCK_STEP` in the same transaction (:func:`claim_function`): the
    lock, not a unique index, keeps two claims of a key apart across partitions. There is no
    ``ON CONFLICT``: no unique index on the partitioned table matches ``(scope, key)``. An
    expired record is deleted and the new one inserted, so it lands in the partition of its
    own claim time and the old partition holds nothing live any more; the insert happens only
    if the delete did delete (or there was no record), because the delete re-checks expiry on
    the row's latest version and an owner may have completed it meanwhile. A takeover of a
    stale record (the same request) updates it in place: it keeps its first claim time, and so
    its partition. ``insert_only``: just the insert of a new record if the key has none, with
    the same result columns (no row when it has one), for the first try of a claim under the
    key lock.
    """

    # Every reference goes through one short alias: psycopg caches its parse of a statement's
    # placeholders only up to 4 KiB of text, and the table's full name in every column
    # reference would take the claim past that, to be parsed again on every request.
    def col(name: str) -> str:
        return f"r.{column(name)}"

    expired = leases.expired_sql(col, NOW)
    stale = f"({leases.run_out_sql(col, NOW)} AND {col('fingerprint')} = %(fingerprint)s)"
    fixed = dict(literals or {})

    def value(name: str) -> str:
        return fixed.get(name) or _value(name)

    def inserted(name: str) -> str:
        return fixed.get(name) or _cast(_value(name), column_types[name])

    updated = [name for name in names if name not in ("scope", "key", "attempts", "created_at")]
    assignments = [f"{column(name)} = {value(name)}" for name in updated]
    # A takeover continues the same logical request: its attempt count and first claim time
    # carry over. An expired record is a new request that happens to reuse the row.
    assignments.append(
        f"{column('attempts')} = CASE WHEN {expired} THEN 1 ELSE {col('attempts')} + 1 END"
    )
    assignments.append(
        f"{column('created_at')} = CASE WHEN {expired} THEN {NOW} ELSE {col('created_at')} END"
    )
    key = f"{col('scope')} = %(scope)s AND {col('key')} = %(key)s"
    row = ", ".join(f"r.{name}" for name in returned) if returned else "r.*"
    lock_held = HOLD_OWNER_LOCK if owner_lock else "false"
    # Evaluated only for a row the claim wrote: a read-only answer commits nothing anyway.
    claimed = (
        "set_config('synchronous_commit', 'off', true) IS NOT NULL"
        if asynchronous_commit
        else "true"
    )
    if insert_only:
        return (
            f"WITH inserted AS ("
            f"INSERT INTO {table} AS r ({', '.join(column(name) for name in names)}) "
            f"SELECT {', '.join(inserted(name) for name in names)} "
            f"WHERE NOT EXISTS (SELECT 1 FROM {table} AS r WHERE {key}) "
            f"RETURNING {row}, {claimed} AS claimed) "
            f"SELECT *, {NOW} AS database_now, {lock_held} AS owner_lock FROM inserted"
        )
    if partitioned:
        # Under the key lock: no other claim of this key runs, so the snapshot's "no record" is
        # still true when the INSERT runs, and the per-partition unique index only backs it up.
        first = (
            f"WITH deleted AS (DELETE FROM {table} AS r WHERE {key} AND {expired} RETURNING 1), "
            f"inserted AS ("
            f"INSERT INTO {table} AS r ({', '.join(column(name) for name in names)}) "
            f"SELECT {', '.join(inserted(name) for name in names)} "
            f"WHERE NOT EXISTS (SELECT 1 FROM {table} AS r WHERE {key}) "
            f"OR EXISTS (SELECT 1 FROM deleted) "
            f"RETURNING {row}, {claimed} AS claimed), "
        )
        taken_over = f"{stale} AND NOT {expired}"
    else:
        first = (
            f"WITH inserted AS ("
            f"INSERT INTO {table} AS r ({', '.join(column(name) for name in names)}) "
            f"SELECT {', '.join(inserted(name) for name in names)} "
            f"WHERE NOT EXISTS (SELECT 1 FROM {table} AS r WHERE {key}) "
            f"ON CONFLICT ({column('scope')}, {column('key')}) DO NOTHING "
            f"RETURNING {row}, {claimed} AS claimed), "
        )
        taken_over = f"({expired} OR {stale})"
    return (
        f"{first}"
        f"reclaimed AS ("
        f"UPDATE {table} AS r SET {', '.join(assignments)} "
        f"WHERE {key} AND {taken_over} "
        f"RETURNING {row}, {claimed} AS claimed) "
        f"SELECT *, {NOW} AS database_now, {lock_held} AS owner_lock FROM inserted UNION ALL "
        f"SELECT *, {NOW} AS database_now, {lock_held} AS owner_lock FROM reclaimed UNION ALL "
        f"SELECT {row}, false AS claimed, {NOW} AS database_now, false AS owner_lock "
        f"FROM {table} AS r "
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

#: Class id of the event-id locks ``publish()`` takes on a partitioned outbox
#: (``OUTBOX_PARTITIONS``) for an event id it was given: unique ``(event_id)`` holds only within
#: each partition, so the lock serialises the look-up across partitions and the INSERT.
EVENT_ID_LOCK_CLASS = 1_638_184_613

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
    connection: BaseDatabaseWrapper,
    *,
    lock_key: str | None,
    notify_channel: str | None,
    lock_event_id: str | None = None,
) -> None:
    """What ``publish()`` does before its INSERT, in one round trip (none if there is nothing).

    ``lock_key``: take the key's transaction-scoped advisory lock, so a second transaction that
    publishes the same key waits here until this one commits or rolls back, and draws its event
    id from the sequence only then: same-key ids are in commit order. ``hashtext`` collisions
    only make two keys take turns needlessly. Rolling back to a savepoint taken before the lock
    releases it.

    ``notify_channel``: ``NOTIFY`` it, which PostgreSQL delivers at commit and drops on rollback,
    so listening relays wake only for committed events.

    ``lock_event_id``: take the event id's transaction-scoped lock (:data:`EVENT_ID_LOCK_CLASS`),
    after the key's: a second transaction publishing the same id waits until this one ends, and
    its look-up (the next statement, a fresh snapshot) then sees this one's event.
    """
    calls: list[str] = []
    params: list[int | str] = []
    if lock_key:
        calls.append("pg_advisory_xact_lock(%s, hashtext(%s::text))")
        params += [OUTBOX_KEY_LOCK_CLASS, lock_key]
    if lock_event_id:
        calls.append("pg_advisory_xact_lock(%s, hashtext(%s::text))")
        params += [EVENT_ID_LOCK_CLASS, lock_event_id]
    if notify_channel:
        calls.append("pg_notify(%s, '')")
        params.append(notify_channel)
    if calls:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {', '.join(calls)}", params)


#: Pins the relay claim's plan for the transaction it runs in (see :func:`fetch_outbox_claim`).
#: The outbox is a queue, so its statistics are usually stale, and a planner that misjudges them
#: fetches every pending row, runs the per-key subqueries on each and sorts them all (seconds,
#: for a backlog of 20,000); without sorting it walks the relay index in order and stops after
#: one batch (milliseconds). Without bitmap scans, each per-key subquery walks its key's index
#: range in order and stops at the first row that answers it (the key's head, mostly); a bitmap
#: scan, which statistics taken with a deep backlog make the planner choose, reads every earlier
#: event of the key for each candidate (28 s for a claim over 100,000 events on 100 keys). JIT
#: would take far longer to compile the plan than the plan takes to run. ``set_config(..., true)``
#: lasts until the transaction ends.
PIN_OUTBOX_CLAIM_PLAN = (
    "SELECT set_config('enable_sort', 'off', true), set_config('enable_bitmapscan', 'off', true), "
    "set_config('jit', 'off', true)"
)

#: The outbox table's fillfactor (its partitions' on a partitioned outbox; migration 0013): an
#: event's page keeps room for the version its claim writes. The claim changes only the lease
#: and the token, which no index holds, so with room on the page the update is HOT: no new
#: entry in any of the table's seven indexes. Packed pages (the default, 100) left nearly
#: every claim writing seven index entries, as many as the insert, and the dead entries slowed
#: every later claim until a vacuum. 40 leaves room on every page (50 left it on nine in ten).
OUTBOX_FILLFACTOR = 40

#: The outbox table's own autovacuum thresholds (its partitions' on a partitioned outbox;
#: migration 0014). A queue's table is small while its dead row versions pile up as fast as
#: events flow, and the claim's per-key checks read the dead index entries of their key until a
#: vacuum removes them; a threshold in changes rather than a fraction of the table has vacuum
#: run every 10,000 of them, unthrottled. The analyze thresholds keep statistics from
#: describing an outbox that is long gone.
OUTBOX_AUTOVACUUM: dict[str, float] = {
    "autovacuum_vacuum_scale_factor": 0,
    "autovacuum_vacuum_threshold": 10_000,
    "autovacuum_vacuum_cost_delay": 0,
    "autovacuum_analyze_scale_factor": 0,
    "autovacuum_analyze_threshold": 10_000,
}

#: Every storage parameter of the outbox table (or of each of its partitions).
OUTBOX_STORAGE: dict[str, float] = {"fillfactor": OUTBOX_FILLFACTOR, **OUTBOX_AUTOVACUUM}


def storage_parameters(parameters: Mapping[str, float]) -> str:
    """``parameters`` as ``ALTER TABLE ... SET (...)`` and ``WITH (...)`` take them."""
    return ", ".join(f"{name} = {value}" for name, value in parameters.items())


#: The outbox itself when it is a plain table, else each of its partitions.
_OUTBOX_TABLES = """
    SELECT c.oid::regclass::text FROM pg_class c
    WHERE c.oid = to_regclass(%(table)s) AND c.relkind = 'r'
    UNION ALL
    SELECT i.inhrelid::regclass::text FROM pg_inherits i WHERE i.inhparent = to_regclass(%(table)s)
"""


def alter_outbox_storage(change: str) -> Callable[[Any, Any], None]:
    """A migration's ``RunPython`` code that runs ``ALTER TABLE <outbox> <change>`` on the
    outbox table, or on each partition when it is partitioned (a partitioned parent takes no
    storage parameters); nothing on other databases. It rewrites no page and takes no lock
    that stops reads or writes."""

    def operation(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            return
        table = apps.get_model("django_idempotency", "OutboxEvent")._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(_OUTBOX_TABLES, {"table": connection.ops.quote_name(table)})
            for (name,) in cursor.fetchall():
                cursor.execute(f"ALTER TABLE {name} {change}")

    return operation


#: What the acknowledgement does to each event of a batch (the ``kind`` of its outcome row).
ACK_SENT, ACK_FAILED, ACK_UNTRIED = "sent", "failed", "untried"

#: The columns of the acknowledgement's outcome rows, after ``id`` and ``kind``: what a failure
#: sets (a published event sets ``status``, and clears the four failure columns it shares).
ACK_COLUMNS = (
    "status",
    "attempts",
    "next_attempt_at",
    "last_error",
    "failure_fingerprint",
    "failing_since",
    "last_failed_at",
    "failure_traceback",
    "failure_kind",
)


#: SQL and its positional parameters.
Fragment = tuple[str, Sequence[Any]]

#: The claim statement's names for a candidate row (a row of ``candidates`` or ``fallback``,
#: with the columns ``id``, ``key`` and ``transaction_id``), for the outsider check to refer to.
CLAIM_CANDIDATE = "candidate"


def outbox_claim_statement(
    table: str,
    column: Callable[[str], str],
    *,
    candidates: Fragment,
    outsiders: Callable[[str], Fragment],
    fallback: Fragment | None,
    returned: Sequence[str],
    pending: str,
    relay_lock: Any,
    lease_seconds: float,
    token: Any,
) -> tuple[str, list[Any]]:
    """The relay's claim as one statement, and its parameters: lock a batch, keep it in key
    order, take the batch's relay lock, lease the batch, and return it with the database's time.

    ``candidates`` is the ORM's candidate query compiled to SQL: due events in relay order that
    no held event of their key blocks, ``LIMIT`` one batch, selecting the id, the key and
    ``transaction_id``; the statement adds ``FOR UPDATE SKIP LOCKED``, so relays side by side
    take disjoint batches. ``fallback``, when relays share the keys, is the query for events
    left waiting by another relay, read (and locked) only when the first keeps nothing.
    ``outsiders(source)`` is the ORM's query for the earlier unpublished events of the row
    :data:`CLAIM_CANDIDATE`'s key that are not in ``source`` (``"candidates"`` or
    ``"fallback"``, whose ``id`` column it reads).

    Each step does what the relay's portable claim does in a statement of its own:

    * ``kept``: a candidate goes only when no earlier unpublished event of its key is left
      outside the batch. ``SKIP LOCKED`` may have skipped that event because another relay is
      claiming it at this moment; sending the later one meanwhile would overtake it. The
      statement's snapshot is enough: an event this snapshot sees unpublished is at worst held
      back until the next pass, and one it does not see yet cannot be earlier than a visible
      event of its key (``publish()`` makes same-key ids follow commit order).
    * ``lock``: with ``relay_lock`` (its id, a parameter like ``token``), the batch's relay
      lock (a session advisory lock, see db/session_locks.py), taken once, only when there is
      a batch, and inside the statement, so before the lease commits: no relay can see the
      lease without the lock. The lock outlives the transaction; the acknowledgement lets go
      of it.
    * ``claimed``: the lease (``lease_seconds`` from the moment of the update, so it never
      starts before the claim was done) and ``token``, fenced on the lease being free and the
      event PENDING (by the candidates' clock) though the statement holds the rows' locks. The
      fence is written so that no index can serve it (``IS TRUE``): the rows are found by their
      ids, whatever the planner believes of the other columns.

    The result has at least one row: ``clock_timestamp()`` (the database's time as the claim
    ends, for the relay's clock), whether the relay lock was taken (NULL: no batch), then the
    ``returned`` columns of each claimed event in relay order (NULL when none was claimed).
    """

    def col(name: str) -> str:
        return f"{table}.{column(name)}"

    params: list[Any] = []

    def step(name: str, sql: str, fragment_params: Sequence[Any] = ()) -> str:
        params.extend(fragment_params)
        return f"{name} AS ({sql})"

    def kept(source: str) -> str:
        outsider, outsider_params = outsiders(source)
        return step(
            f"{source}_kept",
            f"SELECT * FROM {source} AS {CLAIM_CANDIDATE} WHERE {CLAIM_CANDIDATE}.key = '' "
            f"OR NOT EXISTS ({outsider})",
            outsider_params,
        )

    shape = "(id, key, transaction_id)"
    locking = "FOR UPDATE SKIP LOCKED"
    steps = [step(f"candidates {shape}", f"{candidates[0]} {locking}", candidates[1])]
    steps.append(kept("candidates"))
    if fallback is None:
        steps.append(step("batch", "SELECT * FROM candidates_kept"))
    else:
        steps.append(step(f"fallback {shape}", f"{fallback[0]} {locking}", fallback[1]))
        steps.append(kept("fallback"))
        # The fallback runs only when the first query kept nothing: a one-time filter.
        steps.append(
            step(
                "batch",
                "SELECT * FROM candidates_kept UNION ALL SELECT * FROM fallback_kept "
                "WHERE NOT EXISTS (SELECT 1 FROM candidates_kept)",
            )
        )
    held, lock_params = (
        (f"pg_try_advisory_lock({RELAY_LOCK_CLASS}, %s)", [relay_lock])
        if relay_lock is not None
        else ("false", [])
    )
    steps.append(
        step(
            "lock",
            f"SELECT {held} AS held FROM (SELECT 1 FROM batch LIMIT 1) AS any_event",
            lock_params,
        )
    )
    steps.append(
        step(
            "claimed",
            f"UPDATE {table} SET "
            f"{column('locked_until')} = clock_timestamp() + make_interval(secs => %s), "
            f"{column('relay_token')} = %s "
            f"WHERE {col('id')} = ANY(ARRAY(SELECT id FROM batch)) "
            f"AND ({col('status')} = {_literal(pending)} "
            f"AND ({col('locked_until')} IS NULL OR {col('locked_until')} <= {NOW})) IS TRUE "
            f"RETURNING {', '.join(f'{table}.{name}' for name in returned)}",
            [float(lease_seconds), token],
        )
    )
    statement = (
        f"WITH {', '.join(steps)} "
        f"SELECT clock_timestamp(), lock.held, claimed.* FROM (SELECT 1) AS one "
        f"LEFT JOIN lock ON true LEFT JOIN claimed ON true "
        f"ORDER BY claimed.{column('transaction_id')}, claimed.{column('id')}"
    )
    return statement, params


def fetch_outbox_claim(
    connection: BaseDatabaseWrapper, statement: str, params: Sequence[Any]
) -> list[tuple[Any, ...]]:
    """Run the claim ``statement`` with its plan pinned (:data:`PIN_OUTBOX_CLAIM_PLAN`), in one
    round trip, and return its rows.

    A planner setting only reaches statements planned after it is set, so the statement it is
    for cannot set it. The two go in one message of the simple query protocol instead, which
    PostgreSQL runs as one transaction (an implicit one in autocommit, else the caller's): the
    setting lasts until that transaction ends, as ``SET LOCAL`` would, and reaches nothing else
    on the connection. A message of two statements cannot carry parameters, so they are bound
    into the text on the client (as Django's psycopg cursors do unless told to bind on the
    server).
    """
    from django.db.backends.postgresql.psycopg_any import is_psycopg3, mogrify

    text = mogrify(statement, params, connection)
    with connection.cursor() as cursor:
        if is_psycopg3:
            # A batch's rows carry four timestamps each, in text (the simple protocol has no
            # binary results): parsed by the C parser, not psycopg's Python one.
            timezone = getattr(connection, "timezone", None)
            cursor.cursor.adapters.register_loader("timestamptz", _iso_tzloader(timezone))
        cursor.execute(f"{PIN_OUTBOX_CLAIM_PLAN}; {text}")
        if is_psycopg3:  # psycopg 3 starts at the first statement's result, psycopg2 has the last
            cursor.nextset()
        rows: list[tuple[Any, ...]] = cursor.fetchall()
    return rows


@functools.cache
def _iso_tzloader(timezone: datetime.tzinfo | None) -> type:
    """A text ``timestamptz`` loader that gives what Django's gives (the session's wall time,
    in the connection's zone, naive without one) by ``datetime.fromisoformat``: a tenth of
    the time psycopg's parser in Python takes. What it cannot read (``infinity``, a year
    before 1) goes to Django's."""
    from django.db.backends.postgresql.psycopg_any import BaseTzLoader

    class Loader(BaseTzLoader):  # type: ignore[misc]
        def load(self, data: Any) -> Any:
            try:
                parsed = datetime.datetime.fromisoformat(bytes(data).decode())
            except ValueError:
                return super().load(data)
            # A session in UTC gives UTC itself, what Django's loader gives: no copy needed.
            return parsed if parsed.tzinfo is timezone else parsed.replace(tzinfo=timezone)

    Loader.timezone = timezone
    return Loader


def outbox_ack_statement(
    table: str,
    column: Callable[[str], str],
    column_types: Mapping[str, str],
    *,
    relay_lock: bool,
    notify_channel: str | None = None,
) -> str:
    """The relay's acknowledgement of a batch as one statement: every outcome, fenced on the
    relay token, the batch's relay lock let go, and with ``notify_channel`` a NOTIFY there when
    it changed any event (it commits with the statement: waiting relays look again).

    Parameters are named: ``id`` and ``kind`` (:data:`ACK_SENT`, :data:`ACK_FAILED` or
    :data:`ACK_UNTRIED`) and each of :data:`ACK_COLUMNS`, one array each with an element per
    event, ``now`` (when the sent events were published), ``token``, and with ``relay_lock``,
    ``relay_lock`` (the lock's id). ``column_types`` gives the SQL type of ``id`` and of each
    of :data:`ACK_COLUMNS`. The text depends on nothing else, so it is prepared once per
    connection, whatever the batch.

    A sent event is PUBLISHED at ``now`` and its failure columns cleared; a failed one takes
    the outcome's values (its attempts, next attempt, DEAD or not, failure group); an untried
    one keeps everything. All three lose their lease and token, and only where the row still
    carries ``token``: a relay whose lease was taken over changes nothing, and the result says
    which events it did change: one row, the array of their ids and the lock's release.

    The lock is let go inside the statement, before it commits. A relay that finds it free
    meanwhile and releases the batch's leases (``outbox.fleet.GoneRelays``)
    waits for this statement's row locks, and then its UPDATE, fenced on the token, finds the
    token gone and changes nothing.
    """
    name = column
    outcome = ["id", "kind", *ACK_COLUMNS]
    arrays = ", ".join(
        f"CAST(%({field})s AS {column_types.get(field, 'text')}[])" for field in outcome
    )

    def unless(kind: str, field: str) -> str:
        """The outcome's value, except for ``kind``, which keeps the row's."""
        return (
            f"{name(field)} = CASE outcome.kind WHEN {_literal(kind)} THEN {table}.{name(field)} "
            f"ELSE outcome.{field} END"
        )

    def only(kind: str, field: str, value: str) -> str:
        """``value`` for ``kind``; the others keep the row's."""
        return (
            f"{name(field)} = CASE outcome.kind WHEN {_literal(kind)} THEN {value} "
            f"ELSE {table}.{name(field)} END"
        )

    assignments = [
        unless(ACK_UNTRIED, "status"),
        only(ACK_SENT, "published_at", f"CAST(%(now)s AS {column_types['published_at']})"),
        *(
            only(ACK_FAILED, field, f"outcome.{field}")
            for field in ("attempts", "next_attempt_at", "last_failed_at")
        ),
        *(
            unless(ACK_UNTRIED, field)
            for field in (
                "last_error",
                "failure_fingerprint",
                "failing_since",
                "failure_traceback",
                "failure_kind",
            )
        ),
        f"{name('locked_until')} = NULL",
        f"{name('relay_token')} = NULL",
    ]
    released = f"pg_advisory_unlock({RELAY_LOCK_CLASS}, %(relay_lock)s)" if relay_lock else "NULL"
    notified = (
        f", (SELECT pg_notify({_literal(notify_channel)}, '') "
        "FROM (SELECT 1 FROM changed LIMIT 1) AS any_change)"
        if notify_channel
        else ""
    )
    return (
        f"WITH outcome AS (SELECT * FROM unnest({arrays}) AS outcome ({', '.join(outcome)})), "
        f"changed AS (UPDATE {table} SET {', '.join(assignments)} FROM outcome "
        f"WHERE {table}.{name('id')} = outcome.id AND {table}.{name('relay_token')} = %(token)s "
        f"RETURNING {table}.{name('id')}) "
        f"SELECT ARRAY(SELECT changed.{name('id')} FROM changed), {released}{notified}"
    )


def _literal(value: str) -> str:
    """A string constant of the code (a status, say), as SQL."""
    return "'" + value.replace("'", "''") + "'"


# --- inbox -------------------------------------------------------------------------------------

#: Whether :func:`insert_marker` also deletes the message's failure record.
MARKER_CLEARS_FAILURE = True

#: Class id of the inbox locks (``INBOX_PARTITIONS``): a consumer marking a message on a
#: partitioned inbox takes the lock of its ``(consumer, message_id)`` for the transaction first.
INBOX_LOCK_CLASS = 1_638_184_614

#: Class id of the sweeps' session locks, one per sweep (its number the second int): a sweep
#: that finds its lock held skips its run, the previous one still doing the work.
SWEEP_LOCK_CLASS = 1_638_184_615
HOLD_SWEEP_LOCK = f"SELECT pg_try_advisory_lock({SWEEP_LOCK_CLASS}, %s)"
LET_GO_OF_SWEEP_LOCK = f"SELECT pg_advisory_unlock({SWEEP_LOCK_CLASS}, %s)"
#: Run before :func:`insert_marker` with ``partitioned``, as a statement of its own: a second
#: consumer of the message waits here until the first one's transaction ends, and the insert's
#: look-up (the next statement, a fresh snapshot) then sees its marker. A ``hashtext``
#: collision only makes two messages take turns.
INBOX_LOCK_STATEMENT = (
    f"SELECT pg_advisory_xact_lock({INBOX_LOCK_CLASS}, "
    "hashtext(%(consumer)s::text || ' ' || %(message_id)s::text))"
)


def insert_marker(
    marker: str, failed: str, consumer: str, message_id: str, at: str, *, partitioned: bool = False
) -> str:
    """Insert the inbox marker unless it exists, and with it delete the message's failure record.

    One statement with no savepoint (a duplicate is not an error here), where the portable form
    takes four: SAVEPOINT, INSERT, RELEASE, and a DELETE at the end. Its one row, or none, says
    whether the marker is new.

    ``partitioned``: for an inbox partitioned by ``processed_at``, after
    :data:`INBOX_LOCK_STATEMENT`. No unique index of the parent matches ``(consumer,
    message_id)``, so there is no ``ON CONFLICT`` target: the marker is looked up in every
    partition, under the lock, and inserted only if absent (``ON CONFLICT DO NOTHING`` with no
    target still checks the partition's own unique index).
    """
    key = f"{consumer} = %(consumer)s AND {message_id} = %(message_id)s"
    insert = (
        f"INSERT INTO {marker} ({consumer}, {message_id}, {at}) "
        f"SELECT %(consumer)s::text, %(message_id)s::text, %(at)s::timestamptz "
        f"WHERE NOT EXISTS (SELECT 1 FROM {marker} WHERE {key}) ON CONFLICT DO NOTHING RETURNING 1"
        if partitioned
        else f"INSERT INTO {marker} ({consumer}, {message_id}, {at}) "
        f"VALUES (%(consumer)s, %(message_id)s, %(at)s) "
        f"ON CONFLICT ({consumer}, {message_id}) DO NOTHING RETURNING 1"
    )
    return (
        f"WITH inserted AS ({insert}), cleared AS ("
        f"DELETE FROM {failed} WHERE {key} AND EXISTS (SELECT 1 FROM inserted)"
        f") SELECT 1 FROM inserted"
    )
