"""Owner presence: a request holds a session lock while it runs, so a duplicate can tell a
request that is still running from one whose connection is gone.

A lease only says how long a request may take. When the process serving a request dies (a
killed worker, a restarted database), its connection closes and its transaction can never
commit, but the lease still runs for ``LEASE_SECONDS``. So the request that claims a key also
takes a session lock named after its owner token (PostgreSQL: an advisory lock, in the claim
statement itself; MariaDB/MySQL: ``GET_LOCK``), and lets go of it when it completes or releases
the key. A duplicate that finds the key held by a running lease tests that lock: held, the owner
is alive (``409``); free, the owner's session is gone and the duplicate takes the key over at
once (``Verdict.TAKE_OVER_DEAD_OWNER``), with a new owner token as any takeover.

The lease stays the fallback: on SQLite, when ``TAKE_OVER_DEAD_OWNERS`` is off, and for an owner
that is alive but unreachable. A connection pooler that does not keep session state between
transactions (PgBouncer in transaction mode) breaks session locks: turn the setting off behind
one. Whatever the locks say, a takeover never lets work happen twice: the old owner's completion
is fenced by its owner token.
"""

from __future__ import annotations

import uuid

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import conf
from django_idempotency.db import mysql, postgresql

__all__ = ["enabled", "enabled_on", "hold", "let_go", "lock_id", "lock_name", "owner_gone"]


def enabled(using: str) -> bool:
    """Whether requests on this database hold owner locks."""
    return enabled_on(connections[using])


def enabled_on(connection: BaseDatabaseWrapper) -> bool:
    """:func:`enabled`, for a caller that holds the connection already (looking one up by its
    alias costs more than the answer)."""
    return conf.TAKE_OVER_DEAD_OWNERS and connection.vendor in ("postgresql", "mysql")


def lock_id(owner_token: uuid.UUID) -> int:
    """PostgreSQL's advisory lock id of a claim: 32 random bits of its owner token."""
    return int.from_bytes(owner_token.bytes[:4], "big", signed=True)


def lock_name(owner_token: uuid.UUID) -> str:
    """MariaDB's lock name of a claim (at most 64 characters)."""
    return f"idempotency:{owner_token.hex}"


def owner_gone(using: str, owner_token: uuid.UUID) -> bool:
    """Whether the request that claimed with ``owner_token`` no longer holds its lock."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(postgresql.OWNER_GONE, {"owner_lock": lock_id(owner_token)})
        else:
            cursor.execute(mysql.OWNER_GONE, [lock_name(owner_token)])
        return bool(cursor.fetchone()[0])


def hold(using: str, owner_token: uuid.UUID) -> bool:
    """Take this claim's lock (where the claim statement did not already). True if held."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                f"SELECT {postgresql.HOLD_OWNER_LOCK}", {"owner_lock": lock_id(owner_token)}
            )
        else:
            cursor.execute(mysql.HOLD_OWNER_LOCK, [lock_name(owner_token)])
        return bool(cursor.fetchone()[0])


def let_go(using: str, owner_token: uuid.UUID) -> None:
    """Release this claim's lock (on PostgreSQL the completing statement usually does it)."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            statement = f"SELECT {postgresql.LET_GO_OF_OWNER_LOCK}"
            cursor.execute(statement, {"owner_lock": lock_id(owner_token)})
        else:
            cursor.execute(mysql.LET_GO_OF_OWNER_LOCK, [lock_name(owner_token)])
