"""Relay presence: a relay holds a session lock per claimed batch, so other relays can tell a
batch whose relay is gone from one that is still being published.

A relay lease only says how long a batch may take. When a relay dies (a killed process, a lost
pod), its connection closes, but its lease would still hold the batch, and with it every later
event of the batch's keys, until ``OUTBOX_RELAY_LEASE_SECONDS`` ran out. So the claim takes a
session lock named after the batch's relay token (PostgreSQL: an advisory lock; MariaDB/MySQL:
``GET_LOCK``) and the relay lets go of it after the ack. Between batches a relay looks at the
leases at the head of the outbox; a lease whose lock no session holds belongs to a relay that is
gone, and is released at once. A relay that restarts finds its own batch that way on its first
pass, as does any other relay.

The lease stays the fallback: on SQLite, when ``TAKE_OVER_DEAD_OWNERS`` is off (behind a pooler
that does not keep sessions, PgBouncer in transaction mode), and for a relay that is alive but
cannot reach the database. Releasing a dead relay's batch never loses an event: at worst the
dead relay had published some of it, and they go out again with the same event ids.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

from django.db import connections

from django_idempotency.conf import conf
from django_idempotency.db import mysql, postgresql

__all__ = ["enabled", "gone", "hold", "let_go"]


def enabled(using: str) -> bool:
    """Whether relays on this database hold presence locks."""
    return conf.TAKE_OVER_DEAD_OWNERS and connections[using].vendor in ("postgresql", "mysql")


def _lock_id(token: uuid.UUID) -> int:
    return int.from_bytes(token.bytes[:4], "big", signed=True)


def _lock_name(token: uuid.UUID) -> str:
    return f"outbox-relay:{token.hex}"


def _execute(using: str, token: uuid.UUID, on_postgresql: str, on_mysql: str) -> None:
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(on_postgresql, [_lock_id(token)])
        else:
            cursor.execute(on_mysql, [_lock_name(token)])


def hold(using: str, token: uuid.UUID) -> None:
    """Take the batch's lock on this connection (it outlives the claim's transaction)."""
    _execute(using, token, postgresql.HOLD_RELAY_LOCK, mysql.HOLD_OWNER_LOCK)


def let_go(using: str, token: uuid.UUID) -> None:
    """Release the batch's lock, once its ack has committed."""
    _execute(using, token, postgresql.LET_GO_OF_RELAY_LOCK, mysql.LET_GO_OF_OWNER_LOCK)


def gone(using: str, tokens: Collection[uuid.UUID]) -> set[uuid.UUID]:
    """Of ``tokens``, those whose relay no longer holds the batch's lock, in one round trip."""
    if not tokens:
        return set()
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            by_id = {_lock_id(token): token for token in tokens}
            cursor.execute(postgresql.RELAYS_GONE, [list(by_id)])
            return {by_id[row[0]] for row in cursor.fetchall()}
        ordered = list(tokens)
        cursor.execute(mysql.relays_gone(len(ordered)), [_lock_name(t) for t in ordered])
        free = cursor.fetchone()
        return {token for token, is_free in zip(ordered, free, strict=True) if is_free}
