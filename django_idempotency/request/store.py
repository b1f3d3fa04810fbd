"""The record store: a claimed key's record in the database, the source of truth.

A key is claimed in ``claims.py``; everything after the claim is here, each one short statement
judged by the database's clock (``db.database_now`` / ``NOW`` in the SQL):

* :func:`complete` is one UPDATE inside the business transaction, fenced by the owner token: a
  request that lost its lease to a takeover updates nothing, and the caller rolls back.
* :func:`accept` hands the key to a worker (ACCEPTED); :func:`resume` is the worker taking it up.
* :func:`release` deletes the record if this request still owns it, so a retry runs at once.
* :func:`extend` pushes a lease forward (the heartbeat).
* :func:`read` looks a key up without changing or locking anything (status by key).

Every statement on the records table names the record by its scope and key, the unique
constraint, so the table can be distributed by scope (Citus; ``docs/sharding.md``) and each
statement still reaches one shard. ``tests/db/test_shard_ready.py`` holds every path to it.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, cast

from django.db import InterfaceError, OperationalError, connections, router
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field

from django_idempotency.conf import conf
from django_idempotency.core.statemachine import (
    ACCEPTED,
    COMPLETED,
    PROCESSING,
    is_expired,
    seconds_left,
)
from django_idempotency.core.types import Identity, Lease, StoredResponse
from django_idempotency.db import database_now, dialect, prepared, session_locks
from django_idempotency.db import postgresql as pg
from django_idempotency.models import IdempotencyRecord

__all__ = [
    "UNAVAILABLE_ERRORS",
    "KeyState",
    "ResponseColumns",
    "Terms",
    "accept",
    "complete",
    "database_alias",
    "extend",
    "read",
    "record_column",
    "record_field",
    "release",
    "resume",
    "status_of",
    "stored_response",
]


#: Database errors that mean "the database is not there": answered 503 rather than 500, and a
#: key that cannot be released then frees itself when its lease runs out.
UNAVAILABLE_ERRORS = (OperationalError, InterfaceError)


def database_alias() -> str:
    """The database the records are written to, as the routers say."""
    return router.db_for_write(IdempotencyRecord)


@dataclass(frozen=True, slots=True)
class Terms:
    """A key's lease length and TTL: its door's, else the settings' (read live). The claim
    grants a lease on them; a completion, a hand-off and the heartbeat keep to them."""

    lease: float | None = None
    ttl: float | None = None

    @property
    def lease_seconds(self) -> float:
        return conf.LEASE_SECONDS if self.lease is None else self.lease

    @property
    def ttl_seconds(self) -> float:
        return conf.TTL_SECONDS if self.ttl is None else self.ttl

    def lease_for(
        self,
        identity: Identity,
        owner_token: uuid.UUID,
        expires_at: datetime,
        attempt: int,
        using: str,
        owner_lock: bool,
    ) -> Lease:
        return Lease(
            identity,
            owner_token,
            expires_at,
            attempt,
            using,
            owner_lock=owner_lock,
            lease_seconds=self.lease,
            ttl_seconds=self.ttl,
        )


class ResponseColumns(Protocol):
    """A record's response columns: a model instance, or a claim's row read by hand."""

    @property
    def response_status(self) -> int | None: ...
    @property
    def response_headers(self) -> Any: ...
    @property
    def response_body(self) -> Any: ...
    @property
    def response_retained(self) -> bool: ...


def stored_response(record: ResponseColumns) -> StoredResponse:
    """The stored answer of a record, as a replay sends it."""
    body = record.response_body
    headers = record.response_headers
    if isinstance(headers, str):  # a raw cursor reads jsonb as text
        headers = json.loads(headers)
    return StoredResponse(
        status=record.response_status or 200,
        headers=[(str(name), str(value)) for name, value in headers or ()],
        body=bytes(body) if body is not None else b"",
        retained=record.response_retained,
    )


def record_field(name: str) -> Field[Any, Any]:
    return cast("Field[Any, Any]", IdempotencyRecord._meta.get_field(name))


def record_column(name: str) -> str:
    return str(record_field(name).column)


# --- read (status by key) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyState:
    """What a lookup by key may tell its own scope: never the fingerprint or the owner."""

    key: str
    #: ``PROCESSING`` or ``COMPLETED`` (``statemachine``).
    status: str
    created_at: datetime
    expires_at: datetime
    #: The stored response once COMPLETED, else None.
    response: StoredResponse | None
    #: Whole seconds until the running lease ends (at least 1), for a ``Retry-After``.
    retry_after: int


def read(scope: str, key: str) -> KeyState | None:
    """A key's live record, for a lookup that changes nothing (the status-by-key views):
    ``None`` when there is none, or it expired (``statemachine``'s rule).

    A plain read: no lock, so a lookup never waits for (or delays) the request holding the key.
    Expiry is judged by the database's clock, as the claim judges it.
    """
    using = database_alias()
    now = database_now(using)
    record = IdempotencyRecord.objects.using(using).for_key(scope, key).first()
    if record is None or is_expired(record, now):
        return None
    completed = record.status == COMPLETED
    return KeyState(
        key=record.key,
        status=record.status,
        created_at=record.created_at,
        expires_at=record.expires_at,
        response=stored_response(record) if completed else None,
        retry_after=seconds_left(record.lease_expires_at, now),
    )


# --- complete, extend, release -----------------------------------------------------------------


def complete(lease: Lease, stored: StoredResponse, *, held_as: str = PROCESSING) -> bool:
    """Store the response, inside the business transaction, if this request still owns the key.

    False when another request took the key over: the caller must roll back. ``held_as`` is
    the status the owner holds the key in: ACCEPTED for the worker of a handed-off request.
    """
    return _update_owned(lease, _response_values(COMPLETED, stored), "complete", held_as) == 1


def accept(lease: Lease, stored: StoredResponse, hold_seconds: float) -> bool:
    """Hand the key to a worker, inside the transaction that enqueued its work: store the 202
    (retries replay it), keep the owner token (the worker's fence), and hold the key for
    ``hold_seconds``. False when another request took the key over: the caller rolls back."""
    values = _response_values(ACCEPTED, stored)
    return _update_owned(lease, values, "accept", PROCESSING, hold_seconds=hold_seconds) == 1


def resume(lease: Lease) -> bool:
    """The worker of a handed-off request takes up the key, inside its own transaction: the
    row is locked until it commits (so a second delivery waits, then finds it done) and held
    for another ``lease.lease_seconds``. False when the key is not ACCEPTED under this token."""
    return _update_owned(lease, {}, "extend", ACCEPTED) == 1


def status_of(lease: Lease) -> str | None:
    """The status of the key if ``lease``'s owner token still names it, else None."""
    found = (
        IdempotencyRecord.objects.using(lease.using)
        .for_key(lease.identity.scope, lease.identity.key)
        .filter(owner_token=lease.owner_token)
        .values_list("status", flat=True)
        .first()
    )
    return None if found is None else str(found)


def _response_values(status: str, stored: StoredResponse) -> dict[str, Any]:
    return {
        "status": status,
        "response_status": stored.status,
        "response_headers": [[name, value] for name, value in stored.headers],
        "response_body": stored.body,
        "response_retained": stored.retained,
    }


def extend(lease: Lease) -> bool:
    """Push the lease forward by its length (``LEASE_SECONDS`` unless the claim chose one),
    by the database's time. False once it is not ours."""
    return _update_owned(lease, {}, "extend", PROCESSING) == 1


def release(lease: Lease, *, held_as: str = PROCESSING) -> bool:
    """Delete the record if this request still owns it (``held_as``, our owner token), and let
    go of its owner lock. ``held_as`` is ACCEPTED for the worker of a handed-off request.

    Database errors propagate; the caller decides whether a failed release matters.
    """
    connection = connections[lease.using]
    if lease.owner_lock and connection.vendor == "postgresql":
        quote = connection.ops.quote_name
        statement = pg.with_owner_lock_released(
            f"DELETE FROM {quote(IdempotencyRecord._meta.db_table)} "
            f"WHERE {quote(record_column('scope'))} = %s AND {quote(record_column('key'))} = %s "
            f"AND {quote(record_column('owner_token'))} = %s "
            f"AND {quote(record_column('status'))} = %s "
            f"RETURNING 1"
        )
        params = [
            lease.identity.scope,
            lease.identity.key,
            record_field("owner_token").get_db_prep_save(lease.owner_token, connection),
            held_as,
            session_locks.lock_id(lease.owner_token),
        ]
        with prepared.cursor(connection) as cursor:
            cursor.execute(statement, params)
            return bool(cursor.fetchone()[0])
    deleted, _ = (
        IdempotencyRecord.objects.using(lease.using)
        .for_key(lease.identity.scope, lease.identity.key)
        .filter(owner_token=lease.owner_token, status=held_as)
        .delete()
    )
    if lease.owner_lock:
        session_locks.let_go_of_owner(lease.using, lease.owner_token)
    return bool(deleted)


def _update_owned(
    lease: Lease,
    values: dict[str, Any],
    change: str,
    held_as: str,
    *,
    hold_seconds: float | None = None,
) -> int:
    """``UPDATE`` the record if this owner still holds it (``held_as``, our owner token).

    ``change``: ``"complete"`` (completed now, kept its TTL), ``"accept"`` (held
    ``hold_seconds`` more, kept its TTL after that) or ``"extend"`` (the lease pushed forward).
    One hand-built statement, cached per connection: it runs on every request, and the ORM's
    ``update()`` spends most of its time compiling the same query again.
    """
    connection = connections[lease.using]
    postgresql = connection.vendor == "postgresql"
    params = _owned_update_params(values, connection, postgresql)
    terms = Terms(lease.lease_seconds, lease.ttl_seconds)
    sql_dialect = dialect(lease.using)
    if change == "complete":
        params += sql_dialect.now_plus(terms.ttl_seconds)[1]
    elif change == "accept":
        assert hold_seconds is not None
        params += sql_dialect.now_plus(hold_seconds)[1]
        params += sql_dialect.now_plus(hold_seconds + terms.ttl_seconds)[1]
    else:
        params += sql_dialect.now_plus(terms.lease_seconds)[1]
    owner_token = (
        lease.owner_token
        if postgresql
        else record_field("owner_token").get_db_prep_save(lease.owner_token, connection)
    )
    params += [lease.identity.scope, lease.identity.key, owner_token, held_as]
    # The owner lock is the request's: let go once the key is completed or handed to a worker.
    release_lock = change != "extend" and lease.owner_lock
    with prepared.cursor(connection) as cursor:
        sql = _update_owned_sql(lease.using, tuple(values), change)
        if release_lock and postgresql:
            # One round trip: the completion, and the owner lock let go.
            cursor.execute(
                pg.with_owner_lock_released(f"{sql} RETURNING 1"),
                [*params, session_locks.lock_id(lease.owner_token)],
            )
            return int(cursor.fetchone()[0])
        cursor.execute(sql, params)
        updated = int(cursor.rowcount)
    if release_lock:
        session_locks.let_go_of_owner(lease.using, lease.owner_token)
    return updated


def _owned_update_params(
    values: dict[str, Any], connection: BaseDatabaseWrapper, postgresql: bool
) -> list[Any]:
    """The new values as the driver takes them. PostgreSQL's takes the response's status, code,
    body and flag as they are, so only the headers go through their field (into ``jsonb``);
    elsewhere every value does, as the ORM would send it."""
    if not postgresql:
        return [
            record_field(name).get_db_prep_save(value, connection) for name, value in values.items()
        ]
    return [
        record_field(name).get_db_prep_save(value, connection)
        if name == "response_headers"
        else value
        for name, value in values.items()
    ]


@functools.lru_cache(maxsize=32)
def _update_owned_sql(using: str, names: tuple[str, ...], change: str) -> str:
    sql_dialect = dialect(using)
    quote = connections[using].ops.quote_name

    def column(name: str) -> str:
        return quote(record_column(name))

    assignments = [f"{column(name)} = %s" for name in names]
    later, _ = sql_dialect.now_plus(0)
    if change == "complete":
        # Completed now, by the database's clock; kept TTL from now; no lease any more.
        assignments += [
            f"{column('completed_at')} = {sql_dialect.NOW}",
            f"{column('expires_at')} = {later}",
            f"{column('lease_expires_at')} = NULL",
        ]
    elif change == "accept":
        # Held by the worker for its own lease; kept TTL after that, like a PROCESSING record.
        assignments += [
            f"{column('lease_expires_at')} = {later}",
            f"{column('expires_at')} = {later}",
        ]
    else:
        assignments.append(f"{column('lease_expires_at')} = {later}")
    return (
        f"UPDATE {quote(IdempotencyRecord._meta.db_table)} SET {', '.join(assignments)} "
        f"WHERE {column('scope')} = %s AND {column('key')} = %s "
        f"AND {column('owner_token')} = %s AND {column('status')} = %s"
    )
