"""Session locks: a holder's database session says it is still there.

A lease only says how long something may take. When a process dies (a killed worker, a lost
pod, a restarted database), its connection closes and its transaction can never commit, but its
lease would still run. So whoever holds something under a lease also holds a session lock named
after its token (PostgreSQL: an advisory lock, taken inside the claiming statement where it can;
MariaDB/MySQL: ``GET_LOCK``), and lets go of it when done. Another session that finds the lease
running tests the lock: held, the holder is alive; free, the holder's session is gone, and what
it held is taken over at once instead of after the lease.

* **Owners** of idempotency keys (``request/claims.py``): the request that claims a key holds
  its owner lock until it completes or releases it; a duplicate that finds the owner gone takes
  the key over (``Verdict.TAKE_OVER_DEAD_OWNER``), with a new owner token as any takeover.
* **Batches** of outbox events (``outbox/claim.py``): the relay that claims a batch holds its
  lock until the ack; between batches a relay releases the batches of relays that are gone
  (``outbox/fleet.py``).
* **Sweeps**: a sweep holds its lock while it deletes, so a run that starts while the previous
  one still works skips instead of racing it for the same rows.
* **Seats**: each relay holds a seat, numbered from 0, on a connection of its own for as long as
  it runs. Counting the seats held in its database tells a relay how many relays run on that
  outbox and its rank among them, which is how they share the keys (``outbox/claim.py``); relays of
  other databases on the same server are not counted.

The lease stays the fallback: on SQLite, when ``TAKE_OVER_DEAD_OWNERS`` is off (behind a pooler
that does not keep session state between transactions, PgBouncer in transaction mode), and for a
holder that is alive but cannot reach the database. Whatever the locks say, a takeover never
lets work happen twice: an owner's completion is fenced by its owner token, and a dead relay's
events go out again with the same event ids.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import conf
from django_idempotency.db import mysql, postgresql

__all__ = [
    "SEATS",
    "Seat",
    "batches_gone",
    "enabled",
    "enabled_on",
    "fleet",
    "hold_batch",
    "hold_owner",
    "let_go_of_batch",
    "let_go_of_owner",
    "lock_id",
    "owner_gone",
    "owner_lock_name",
    "seat_connection",
    "sweep",
    "take_seat",
]


def enabled(using: str) -> bool:
    """Whether holders on this database take session locks."""
    return enabled_on(connections[using])


def enabled_on(connection: BaseDatabaseWrapper) -> bool:
    """:func:`enabled`, for a caller that holds the connection already (looking one up by its
    alias costs more than the answer)."""
    return conf.TAKE_OVER_DEAD_OWNERS and connection.vendor in ("postgresql", "mysql")


def lock_id(token: uuid.UUID) -> int:
    """PostgreSQL's advisory lock id of a token: 32 of its random bits (an owner's lock and a
    batch's are told apart by the lock's class, ``db/postgresql.py``)."""
    return int.from_bytes(token.bytes[:4], "big", signed=True)


# --- owners of idempotency keys ----------------------------------------------------------------


def owner_lock_name(owner_token: uuid.UUID) -> str:
    """MariaDB's lock name of a claim (at most 64 characters)."""
    return f"idempotency:{owner_token.hex}"


def owner_gone(using: str, owner_token: uuid.UUID) -> bool:
    """Whether the request that claimed with ``owner_token`` no longer holds its lock."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(postgresql.OWNER_GONE, {"owner_lock": lock_id(owner_token)})
        else:
            cursor.execute(mysql.OWNER_GONE, [owner_lock_name(owner_token)])
        return bool(cursor.fetchone()[0])


def hold_owner(using: str, owner_token: uuid.UUID) -> bool:
    """Take a claim's lock (where the claim statement did not already). True if held."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                f"SELECT {postgresql.HOLD_OWNER_LOCK}", {"owner_lock": lock_id(owner_token)}
            )
        else:
            cursor.execute(mysql.HOLD_OWNER_LOCK, [owner_lock_name(owner_token)])
        return bool(cursor.fetchone()[0])


def let_go_of_owner(using: str, owner_token: uuid.UUID) -> None:
    """Release a claim's lock (on PostgreSQL the completing statement usually does it)."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            statement = f"SELECT {postgresql.LET_GO_OF_OWNER_LOCK}"
            cursor.execute(statement, {"owner_lock": lock_id(owner_token)})
        else:
            cursor.execute(mysql.LET_GO_OF_OWNER_LOCK, [owner_lock_name(owner_token)])


# --- batches of outbox events ------------------------------------------------------------------


def _batch_lock_name(token: uuid.UUID) -> str:
    return f"outbox-relay:{token.hex}"


def _execute_batch(using: str, token: uuid.UUID, on_postgresql: str, on_mysql: str) -> None:
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(on_postgresql, [lock_id(token)])
        else:
            cursor.execute(on_mysql, [_batch_lock_name(token)])


def hold_batch(using: str, token: uuid.UUID) -> None:
    """Take a batch's lock on this connection (it outlives the claim's transaction)."""
    _execute_batch(using, token, postgresql.HOLD_RELAY_LOCK, mysql.HOLD_OWNER_LOCK)


def let_go_of_batch(using: str, token: uuid.UUID) -> None:
    """Release a batch's lock, once its ack has committed."""
    _execute_batch(using, token, postgresql.LET_GO_OF_RELAY_LOCK, mysql.LET_GO_OF_OWNER_LOCK)


def batches_gone(using: str, tokens: Collection[uuid.UUID]) -> set[uuid.UUID]:
    """Of ``tokens``, those whose relay no longer holds the batch's lock, in one round trip."""
    if not tokens:
        return set()
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            by_id = {lock_id(token): token for token in tokens}
            cursor.execute(postgresql.RELAYS_GONE, [list(by_id)])
            return {by_id[row[0]] for row in cursor.fetchall()}
        ordered = list(tokens)
        cursor.execute(mysql.relays_gone(len(ordered)), [_batch_lock_name(t) for t in ordered])
        free = cursor.fetchone()
        return {token for token, is_free in zip(ordered, free, strict=True) if is_free}


# --- sweeps -------------------------------------------------------------------------------------

#: Each sweep's number, for its PostgreSQL advisory lock.
_SWEEP_NUMBERS = {"idempotency_records": 1, "outbox_events": 2, "processed_messages": 3}


@contextlib.contextmanager
def sweep(using: str, name: str) -> Iterator[bool]:
    """Whether this run holds the sweep's session lock (always True where there is none). A
    session lock, not a transaction's: the sweep commits batch by batch on this connection."""
    connection = connections[using]
    if not enabled_on(connection):
        yield True
        return
    parameter: int | str
    if connection.vendor == "postgresql":
        hold, let_go = postgresql.HOLD_SWEEP_LOCK, postgresql.LET_GO_OF_SWEEP_LOCK
        parameter = _SWEEP_NUMBERS[name]
    else:
        hold, let_go, parameter = mysql.HOLD_SWEEP_LOCK, mysql.LET_GO_OF_SWEEP_LOCK, name
    with connection.cursor() as cursor:
        cursor.execute(hold, [parameter])
        held = bool(cursor.fetchone()[0])
    try:
        yield held
    finally:
        # A session that closed or broke took the lock with it: nothing to let go of then (and
        # a new session, opened to let go, would hold nothing).
        if held and connection.connection is not None:
            with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute(let_go, [parameter])


# --- relays' seats -----------------------------------------------------------------------------

#: Seats there are: relays beyond this many run without one and take from every key.
SEATS = 64


@dataclass(frozen=True, slots=True)
class Seat:
    """A relay's place in the fleet: the seat it holds, its rank among the seats held, and how
    many are held (the number of running relays)."""

    number: int
    rank: int
    fleet: int


def take_seat(connection: BaseDatabaseWrapper) -> Seat | None:
    """Hold a seat on this connection, or keep the one it holds, and say where it ranks;
    ``None`` when every seat is taken. One round trip when the seat is already held.

    Relays are counted by session, and ranked by their lowest seat, so a session that somehow
    holds two seats still counts once and no share of the keys is left without a relay.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(postgresql.RELAY_SEATS)
            rows = cursor.fetchall()
            held = [(seat, holder) for seat, holder, _ in rows]
            me = next((holder for _, holder, own in rows if own), None)
            if me is None:
                cursor.execute("SELECT pg_backend_pid()")
                me = cursor.fetchone()[0]
                taken = {seat for seat, _ in held}
                for seat in (number for number in range(SEATS) if number not in taken):
                    cursor.execute(postgresql.TAKE_RELAY_SEAT, [seat])
                    if cursor.fetchone()[0]:
                        held.append((seat, me))
                        break
                else:
                    return None
        else:
            cursor.execute(mysql.relay_seats(SEATS), list(range(SEATS)))
            *holders, me = cursor.fetchone()
            held = [(seat, holder) for seat, holder in enumerate(holders) if holder is not None]
            if me not in holders:
                for seat in (number for number, holder in enumerate(holders) if holder is None):
                    cursor.execute(mysql.TAKE_RELAY_SEAT, [seat])
                    if cursor.fetchone()[0] == 1:
                        held.append((seat, me))
                        break
                else:
                    return None
    first_seat: dict[Any, int] = {}
    for seat, holder in sorted(held):
        first_seat.setdefault(holder, seat)
    ranked = sorted(first_seat, key=first_seat.__getitem__)
    return Seat(number=first_seat[me], rank=ranked.index(me), fleet=len(ranked))


def fleet(using: str) -> int:
    """How many relays hold a seat, without taking one."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(postgresql.RELAY_SEATS)
            return len({holder for _, holder, _ in cursor.fetchall()})
        cursor.execute(mysql.relay_seats(SEATS), list(range(SEATS)))
        *holders, _ = cursor.fetchone()
        return len({holder for holder in holders if holder is not None})


def seat_connection(using: str) -> BaseDatabaseWrapper:
    """A connection of the relay's own for its seat, apart from the thread's (autocommit, so it
    never sits in a transaction holding a snapshot)."""
    return connections.create_connection(using)
