"""Claiming a key: what a request may do with its key, and the lease it wins.

Each claim is judged by the database's clock (``db.database_now`` / ``NOW`` in the SQL) and by
the rules of ``core/statemachine.py``; what happens to the record after it is ``store.py``'s.

* :func:`claim` runs in autocommit, committed before the view's transaction opens, so a
  concurrent duplicate sees the PROCESSING record at once and never waits on the first
  request's business transaction. On PostgreSQL it is one statement for every path; on a
  records table partitioned by day (``RECORD_PARTITIONS``) that statement calls a function
  that takes the key's lock and then claims, since no unique index spans the partitions.
  Elsewhere it reads the record and the time, then inserts or takes the key over, fenced.
* :func:`answer` decides a likely retry that needs no write (a replay, a 409, a 422) with one
  plain read on PostgreSQL, where the claim statement would cost the server more.

Every statement names the record by its scope and key, the unique constraint, so a table
distributed by scope (Citus; ``docs/sharding.md``) routes each to one shard.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db import IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Q

from django_idempotency.conf import conf
from django_idempotency.core import leases
from django_idempotency.core.statemachine import PROCESSING, Verdict, judge, seconds_left
from django_idempotency.core.types import (
    Conflict,
    Decision,
    Identity,
    Mismatch,
    Proceed,
    Replay,
)
from django_idempotency.db import dialect, prepared, rows, session_locks, to_datetime
from django_idempotency.db import postgresql as pg
from django_idempotency.exceptions import PartitionMissing
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request.store import (
    Terms,
    database_alias,
    record_column,
    record_field,
    stored_response,
)

__all__ = ["CLAIM_ROUNDS", "answer", "claim", "create_claim_functions"]

#: A claim that keeps losing races to the same record gives up after this many rounds and
#: answers 409: that other request is active right now.
CLAIM_ROUNDS = 5


def claim(
    identity: Identity,
    owner_token: uuid.UUID,
    *,
    lease_seconds: float | None = None,
    ttl_seconds: float | None = None,
    connection: BaseDatabaseWrapper | None = None,
) -> Decision:
    """What this request may do with its key. Database errors propagate to the caller.

    ``lease_seconds`` and ``ttl_seconds`` override ``LEASE_SECONDS`` and ``TTL_SECONDS`` for
    this key; the lease granted carries them, so its heartbeat and completion use them too.
    ``connection``: the records' database's, when the caller has it (else looked up).
    """
    if connection is None:
        connection = connections[database_alias()]
    claim_round = _claim_portable
    if connection.vendor == "postgresql":
        claim_round = _claim_partitioned if conf.RECORD_PARTITIONS else _claim_postgresql
    terms = Terms(lease_seconds, ttl_seconds)
    for _ in range(CLAIM_ROUNDS):
        decision = claim_round(identity, connection, owner_token, terms)
        if decision is not None:
            return decision
    return Conflict(retry_after=1)


class _Found(NamedTuple):
    """A claimed or judged record, as the claim reads it: only what a decision, a replay or a
    lease needs, in the order the claim statement returns it. A tuple rather than a model
    instance: building the model (all its columns, ``__init__`` and its signal) cost more than
    the decision that reads it, on every replay."""

    pk: Any
    status: str
    fingerprint: str
    owner_token: uuid.UUID
    lease_expires_at: datetime | None
    expires_at: datetime
    attempts: int
    response_status: int | None
    response_headers: Any
    response_body: bytes | None
    response_retained: bool

    @classmethod
    def of(cls, record: IdempotencyRecord) -> _Found:
        return cls(*(getattr(record, name) for name in cls._fields))


@functools.cache
def _found_columns() -> tuple[str, ...]:
    """The columns of :class:`_Found`'s fields, in its order."""
    return tuple(
        str(IdempotencyRecord._meta.pk.column) if name == "pk" else record_column(name)
        for name in _Found._fields
    )


def _decision(
    record: _Found | None, identity: Identity, now: datetime, using: str
) -> Verdict | Decision:
    """The state machine's verdict, turned into a decision when it needs no write.

    A key held by a running lease is asked one more question where owners hold session locks
    (``db/session_locks.py``): is its owner still there?
    """
    verdict = judge(record, identity.fingerprint, now)
    if record is None:
        return verdict
    if (
        verdict is Verdict.CONFLICT
        and session_locks.enabled(using)
        and session_locks.owner_gone(using, record.owner_token)
    ):
        verdict = judge(record, identity.fingerprint, now, owner_gone=True)
    if verdict is Verdict.REPLAY:
        return Replay(stored_response(record), expires_in=(record.expires_at - now).total_seconds())
    if verdict is Verdict.HANDED_OFF:
        return Replay(stored_response(record), handed_off=True)
    if verdict is Verdict.CONFLICT:
        return Conflict(retry_after=seconds_left(record.lease_expires_at, now))
    if verdict is Verdict.MISMATCH:
        return Mismatch()
    return verdict


def _claim_portable(
    identity: Identity, connection: BaseDatabaseWrapper, owner_token: uuid.UUID, terms: Terms
) -> Decision | None:
    """Read the record and the database's time, then INSERT or a fenced takeover UPDATE.

    Every statement commits on its own. Inside an outer transaction (which defeats the point,
    but happens in tests and under ATOMIC_REQUESTS) the read locks, because MariaDB's
    REPEATABLE READ snapshot would otherwise hide a row another request just committed.
    """
    using = connection.alias
    record, now = _read_with_time(identity, using)
    found = None if record is None else _Found.of(record)
    verdict = _decision(found, identity, now, using)
    if not isinstance(verdict, Verdict):
        return verdict
    if verdict is Verdict.TAKE_OVER_DEAD_OWNER:
        assert found is not None
        return _take_over_dead_owner(identity, using, owner_token, found, now, terms)
    lease_expires_at = now + timedelta(seconds=terms.lease_seconds)
    values = {
        "fingerprint": identity.fingerprint,
        "status": PROCESSING,
        "owner_token": owner_token,
        "lease_expires_at": lease_expires_at,
        "method": identity.method,
        "path": identity.path,
        # A PROCESSING record outlives its lease by the TTL, so the sweep eventually removes a
        # key whose client never came back.
        "expires_at": lease_expires_at + timedelta(seconds=terms.ttl_seconds),
    }
    takeover = verdict is Verdict.TAKE_OVER
    attempt = record.attempts + 1 if record is not None and takeover else 1
    with _owner_lock(using, owner_token) as held:
        if record is None:
            try:
                with _statement_savepoint(using):
                    IdempotencyRecord.objects.using(using).create(
                        scope=identity.scope, key=identity.key, created_at=now, **values
                    )
            except IntegrityError:
                return None  # a concurrent request inserted it first: read it again
        else:
            # Fenced on the record being as we judged it: same owner, and still absent or stale
            # by the same rules, so a request that completed or took it over meanwhile is never
            # overwritten. The scope and key name the row as every other statement here does,
            # so a table distributed by scope routes it to one shard (docs/sharding.md).
            updated = (
                IdempotencyRecord.objects.using(using)
                .for_key(identity.scope, identity.key)
                .filter(pk=record.pk, owner_token=record.owner_token)
                .filter(_stale_q(now, identity.fingerprint) if takeover else leases.expired_q(now))
                .update(
                    **values,
                    attempts=attempt,
                    created_at=record.created_at if takeover else now,
                    response_status=None,
                    response_headers=[],
                    response_body=None,
                    response_retained=True,
                    completed_at=None,
                )
            )
            if updated != 1:
                return None
        held.keep()
    return Proceed(
        terms.lease_for(identity, owner_token, lease_expires_at, attempt, using, held.taken)
    )


def _stale_q(now: datetime, fingerprint: str) -> Q:
    """What ``Verdict.TAKE_OVER`` may replace: the same request, its lease run out."""
    return leases.run_out_q(now) & Q(fingerprint=fingerprint)


class _HeldLock:
    """An owner lock taken before the write that names its owner; let go unless kept."""

    def __init__(self, taken: bool) -> None:
        self.taken = taken
        self.kept = False

    def keep(self) -> None:
        self.kept = True


@contextmanager
def _owner_lock(using: str, owner_token: uuid.UUID) -> Iterator[_HeldLock]:
    """Take this claim's owner lock *before* the write that makes the record name it.

    Taken after, there would be a moment when a duplicate sees the new owner's running lease
    and a free lock, and takes the key over from a request that is alive. (The PostgreSQL
    claim statement takes it in the same statement as its write, so it is held before the row
    is visible.) The lock is let go again if the claim does not win.
    """
    held = _HeldLock(session_locks.enabled(using) and session_locks.hold_owner(using, owner_token))
    try:
        yield held
    finally:
        if held.taken and not held.kept:
            session_locks.let_go_of_owner(using, owner_token)


def _take_over_dead_owner(
    identity: Identity,
    using: str,
    owner_token: uuid.UUID,
    record: _Found,
    now: datetime,
    terms: Terms,
) -> Decision | None:
    """Take over a key whose owner's session is gone, before its lease runs out.

    Fenced on the owner token it had when judged: if that request completed or released the
    key meanwhile, nothing changes and the claim looks again.
    """
    lease_expires_at = now + timedelta(seconds=terms.lease_seconds)
    attempt = record.attempts + 1
    with _owner_lock(using, owner_token) as held:
        updated = (
            IdempotencyRecord.objects.using(using)
            .for_key(identity.scope, identity.key)
            .filter(pk=record.pk, owner_token=record.owner_token, status=PROCESSING)
            .filter(fingerprint=identity.fingerprint)
            .update(
                owner_token=owner_token,
                lease_expires_at=lease_expires_at,
                expires_at=lease_expires_at + timedelta(seconds=terms.ttl_seconds),
                attempts=attempt,
                method=identity.method,
                path=identity.path,
            )
        )
        if updated != 1:
            return None
        held.keep()
    return Proceed(
        terms.lease_for(identity, owner_token, lease_expires_at, attempt, using, held.taken)
    )


def _read_with_time(identity: Identity, using: str) -> tuple[IdempotencyRecord | None, datetime]:
    """The record, if any, and the database's time, in one statement.

    The record is left-joined to a one-row table, so the time comes back whether or not the
    key exists. Inside an outer transaction the read locks (``FOR UPDATE``) where the database
    can: MariaDB's REPEATABLE READ snapshot would otherwise hide a row another request just
    committed.
    """
    connection = connections[using]
    lock = connection.in_atomic_block and connection.features.has_select_for_update
    with connection.cursor() as cursor:
        cursor.execute(_read_with_time_sql(using, lock), [identity.scope, identity.key])
        now, *columns = cursor.fetchone()
    now = to_datetime(now)
    if columns[0] is None:  # no row joined: the primary key is NULL
        return None, now
    # A raw cursor skips the conversions the ORM would apply (SQLite's text timestamps, JSON).
    record = rows.from_row(IdempotencyRecord, using, columns)
    return record, now


@functools.lru_cache(maxsize=16)
def _read_with_time_sql(using: str, lock: bool) -> str:
    quote = connections[using].ops.quote_name

    def column(name: str) -> str:
        return f"record.{quote(record_column(name))}"

    columns = ", ".join(column(name) for name in rows.attnames(IdempotencyRecord))
    return (
        f"SELECT {dialect(using).NOW}, {columns} FROM (SELECT 1 AS one) AS one "
        f"LEFT JOIN {quote(IdempotencyRecord._meta.db_table)} AS record "
        f"ON {column('scope')} = %s AND {column('key')} = %s" + (" FOR UPDATE" if lock else "")
    )


@contextmanager
def _statement_savepoint(using: str) -> Iterator[None]:
    """A savepoint only when a transaction is open; in autocommit the statement is atomic."""
    if connections[using].in_atomic_block:
        with transaction.atomic(using=using):
            yield
    else:
        yield


def _claim_postgresql(
    identity: Identity, connection: BaseDatabaseWrapper, owner_token: uuid.UUID, terms: Terms
) -> Decision | None:
    """One statement (``db/postgresql.py``): claimed, or the row and the time to judge it by."""
    using = connection.alias
    params = _claim_params(identity, owner_token, terms)
    owner_lock = session_locks.enabled_on(connection)
    # A plain cursor rather than .raw(): this runs on every write request, and building the row
    # by hand costs a fraction of RawQuerySet's column resolution. Binary results: the row's
    # timestamps, token and body decode without parsing text.
    with prepared.cursor(connection, binary=True) as cursor:
        statement = _postgresql_claim_text(using, owner_lock, not connection.in_atomic_block)
        cursor.execute(statement, params)
        row = cursor.fetchone()
    return _claimed_or_judged(identity, using, owner_token, terms, row)


def answer(identity: Identity, connection: BaseDatabaseWrapper) -> Decision | None:
    """The decision on a key that needs no write, for a request that is likely a retry: a
    replay, a request in flight (409) or a mismatch (422). None when the key must be claimed
    (absent, expired or to be taken over), or where only the claim can tell.

    On PostgreSQL it is one plain indexed read, which takes no lock or transaction id and
    costs the server less than the claim statement (which would only read such a key too).
    Not inside a caller's transaction, whose snapshot may be older than the key's answer, and
    not elsewhere: MariaDB's and SQLite's claims read first anyway.
    """
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return None
    return _read_postgresql(identity, connection)


def _read_postgresql(identity: Identity, connection: BaseDatabaseWrapper) -> Decision | None:
    """:func:`answer`'s read; None for a verdict to claim, which the claim decides again on
    what it finds then, by the same rules."""
    using = connection.alias
    with prepared.cursor(connection, binary=True) as cursor:
        cursor.execute(_postgresql_read_text(using), {"scope": identity.scope, "key": identity.key})
        row = cursor.fetchone()
    if row is None:
        return None
    *columns, now = row
    decision = _decision(_Found(*columns), identity, now, using)
    return None if isinstance(decision, Verdict) else decision


@functools.lru_cache(maxsize=16)
def _postgresql_read_text(using: str) -> str:
    quote = connections[using].ops.quote_name
    columns = ", ".join(f"r.{quote(column)}" for column in _found_columns())
    return (
        f"SELECT {columns}, {pg.NOW} FROM {quote(IdempotencyRecord._meta.db_table)} AS r "
        f"WHERE r.{quote(record_column('scope'))} = %(scope)s "
        f"AND r.{quote(record_column('key'))} = %(key)s"
    )


def _claim_partitioned(
    identity: Identity, connection: BaseDatabaseWrapper, owner_token: uuid.UUID, terms: Terms
) -> Decision | None:
    """The claim on a records table partitioned by day (``RECORD_PARTITIONS``): the key's lock,
    then the claim statement, each with its own snapshot (``pg.KEY_LOCK_STEP`` says why),
    run by a server-side function (``pg.claim_function``) so that the client sends one
    prepared statement, as the plain table's claim does.

    A claim whose time falls in no partition fails with :class:`PartitionMissing`, having
    written nothing: there is no default partition for it to land in unseen.
    """
    using = connection.alias
    params = _claim_params(identity, owner_token, terms)
    owner_lock, own_transaction = (
        session_locks.enabled_on(connection),
        not connection.in_atomic_block,
    )
    call = _claim_function(using, owner_lock, own_transaction)
    try:
        with prepared.cursor(connection, binary=True) as cursor:
            if call is None:  # inside a transaction, before the function exists: two statements
                cursor.execute(pg.KEY_LOCK_STATEMENT, params)
                call = _postgresql_claim_text(using, owner_lock, False, partitioned=True)
            cursor.execute(call, params)
            row = cursor.fetchone()
    except IntegrityError as exc:
        if "no partition of relation" in str(exc):
            raise PartitionMissing(
                f"No partition of {IdempotencyRecord._meta.db_table} covers this claim's time "
                f"(IDEMPOTENCY['RECORD_PARTITIONS'] is on). Create the partitions ahead: run "
                f"`manage.py idempotency_partitions create` now, and schedule it (or the "
                f"maintain_record_partitions task) daily."
            ) from exc
        raise
    return _claimed_or_judged(identity, using, owner_token, terms, row)


#: The claim functions known to exist, per database connection (the driver's connection: a new
#: one, perhaps to a database made since, looks again).
_functions_seen: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _claim_function(using: str, owner_lock: bool, own_transaction: bool) -> str | None:
    """The call of the partitioned claim's function, created first if this connection has not
    seen it yet; None inside a caller's transaction when it does not exist yet (created there,
    it would stay invisible to every other claim, and its creator's lock held, until that
    transaction ends). Its name carries a digest of its text: a new version of the statement
    (or of the table's columns) is a new function, never one replaced under a running claim.
    ``idempotency_partitions partition`` creates them ahead."""
    connection = connections[using]
    ddl, call, name = _claim_function_text(using, owner_lock, own_transaction)
    connection.ensure_connection()
    seen = _functions_seen.setdefault(connection.connection, set())
    if name in seen:
        return call
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regproc(%s) IS NOT NULL", [name])
        if not cursor.fetchone()[0]:
            if connection.in_atomic_block:
                return None
            # Serialised: CREATE OR REPLACE of one function by two sessions at once can fail.
            with transaction.atomic(using=using):
                cursor.execute("SELECT pg_advisory_xact_lock(%s, 0)", [pg.RECORD_KEY_LOCK_CLASS])
                cursor.execute(ddl)
    seen.add(name)
    return call


def create_claim_functions(using: str) -> None:
    """Create every variant of the partitioned claim's function, outside any transaction."""
    for owner_lock in (False, True):
        for own_transaction in (False, True):
            ddl, _, _ = _claim_function_text(using, owner_lock, own_transaction)
            with transaction.atomic(using=using), connections[using].cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s, 0)", [pg.RECORD_KEY_LOCK_CLASS])
                cursor.execute(ddl)


@functools.lru_cache(maxsize=16)
def _claim_function_text(
    using: str, owner_lock: bool, own_transaction: bool
) -> tuple[str, str, str]:
    connection = connections[using]
    statement = _postgresql_claim_text(using, owner_lock, own_transaction, partitioned=True)
    types = {name: str(record_field(name).db_type(connection)) for name in _CLAIM_COLUMNS}
    parameters = [
        (name, types[name])
        for name in ("scope", "key", "fingerprint", "owner_token", "method", "path")
    ]
    parameters += [("lease_seconds", "double precision"), ("expiry_seconds", "double precision")]
    if owner_lock:
        parameters.append(("owner_lock", "integer"))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute "
            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
            [connection.ops.quote_name(IdempotencyRecord._meta.db_table)],
        )
        column_types = dict(cursor.fetchall())
    returned = [(column, column_types[column]) for column in _found_columns()]
    returned += [
        ("claimed", "boolean"),
        ("database_now", "timestamp with time zone"),
        ("owner_lock", "boolean"),
    ]
    insert = _postgresql_claim_text(using, owner_lock, own_transaction, insert_only=True)
    text = f"{pg.KEY_LOCK_STEP}{insert}{statement}{parameters}{returned}"
    name = f"django_idempotency_claim_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    ddl, call = pg.claim_function(name, statement, parameters, returned, insert=insert)
    return ddl, call, name


def _claim_params(identity: Identity, owner_token: uuid.UUID, terms: Terms) -> dict[str, Any]:
    """The claim statement's parameters.

    PostgreSQL only: its driver takes these as they are (text, and the owner token as a native
    uuid), so the fields' get_db_prep_save, which would return each value unchanged, is skipped.
    """
    params: dict[str, Any] = {
        "scope": identity.scope,
        "key": identity.key,
        "fingerprint": identity.fingerprint,
        "owner_token": owner_token,
        "method": identity.method,
        "path": identity.path,
    }
    params["lease_seconds"] = terms.lease_seconds
    params["expiry_seconds"] = terms.lease_seconds + terms.ttl_seconds
    params["owner_lock"] = session_locks.lock_id(owner_token)
    return params


def _claimed_or_judged(
    identity: Identity,
    using: str,
    owner_token: uuid.UUID,
    terms: Terms,
    row: Any,
) -> Decision | None:
    """The claim statement's row (:class:`_Found`'s columns, then whether it claimed, the
    database's time and whether it took the owner lock): the lease it won, or the state
    machine's decision on it."""
    if row is None:
        return None
    *columns, claimed, now, held = row
    record = _Found(*columns)
    if claimed:
        assert record.lease_expires_at is not None  # a claimed record always has a lease
        lease = terms.lease_for(
            identity, owner_token, record.lease_expires_at, record.attempts, using, bool(held)
        )
        return Proceed(lease)
    decision = _decision(record, identity, now, using)
    if decision is Verdict.TAKE_OVER_DEAD_OWNER:
        return _take_over_dead_owner(identity, using, owner_token, record, now, terms)
    # A verdict to claim means the row changed after this statement's snapshot: look again.
    return None if isinstance(decision, Verdict) else decision


#: The inserted columns (their parameters are named after them; the times come from the database,
#: see ``db.postgresql.claim_statement``).
_CLAIM_COLUMNS = (
    "scope", "key", "fingerprint", "status", "owner_token", "method", "path", "attempts",
    "response_status", "response_headers", "response_body", "response_retained",
    "completed_at", "created_at", "lease_expires_at", "expires_at",
)  # fmt: skip
#: What every claim writes the same: a PROCESSING record with no response yet (first attempt;
#: a takeover's attempt count is the statement's own).
_CLAIM_LITERALS = {
    "status": f"'{PROCESSING}'",
    "attempts": "1",
    "response_status": "NULL",
    "response_headers": "'[]'",
    "response_body": "NULL",
    "response_retained": "true",
    "completed_at": "NULL",
}


@functools.lru_cache(maxsize=16)
def _postgresql_claim_text(
    using: str,
    owner_lock: bool,
    own_transaction: bool,
    partitioned: bool = False,
    insert_only: bool = False,
) -> str:
    """The claim statement; its text depends only on the connection, so it is built once.

    Only a claim that is its own transaction commits asynchronously: inside a caller's open
    transaction the setting would reach the caller's own commit."""
    connection = connections[using]
    quote = connection.ops.quote_name
    return pg.claim_statement(
        quote(IdempotencyRecord._meta.db_table),
        lambda name: quote(record_column(name)),
        _CLAIM_COLUMNS,
        column_types={name: str(record_field(name).db_type(connection)) for name in _CLAIM_COLUMNS},
        literals=_CLAIM_LITERALS,
        returned=[quote(column) for column in _found_columns()],
        owner_lock=owner_lock,
        asynchronous_commit=own_transaction,
        partitioned=partitioned,
        insert_only=insert_only,
    )
