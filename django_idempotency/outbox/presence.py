"""Relay presence: a relay holds a session lock per claimed batch, so other relays can tell a
batch whose relay is gone from one that is still being published.

A relay lease only says how long a batch may take. When a relay dies (a killed process, a lost
pod), its connection closes, but its lease would still hold the batch, and with it every later
event of the batch's keys, until ``OUTBOX_RELAY_LEASE_SECONDS`` ran out. So the claim takes a
session lock named after the batch's relay token (PostgreSQL: an advisory lock, inside the claim
statement; MariaDB/MySQL: ``GET_LOCK``, before the claim commits) and the relay lets go of it
with the ack (PostgreSQL: inside the ack's statement; MariaDB/MySQL: after it commits). Between
batches a relay looks at the leases at the head of the outbox; a lease whose lock no session
holds belongs to a relay that is gone, and is released at once. A relay that restarts finds its
own batch that way on its first pass, as does any other relay.

Relays also hold a *seat* each, numbered from 0: a session lock on a connection of the relay's
own, kept for as long as the relay runs (its ordinary connection may close between passes, as
``CONN_MAX_AGE`` says). Counting the seats held in its database tells a relay how many relays
run on that outbox and its rank among them, which is how they share the keys (see
``Relay._claim``); relays of other databases on the same server are not counted. A relay
that stops or dies leaves its seat with that connection, and the others' ranks and count change
at their next look, within a second.

The lease stays the fallback: on SQLite, when ``TAKE_OVER_DEAD_OWNERS`` is off (behind a pooler
that does not keep sessions, PgBouncer in transaction mode), and for a relay that is alive but
cannot reach the database. Releasing a dead relay's batch never loses an event: at worst the
dead relay had published some of it, and they go out again with the same event ids.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import conf
from django_idempotency.db import mysql, postgresql

__all__ = [
    "SEATS",
    "Seat",
    "enabled",
    "fleet",
    "gone",
    "hold",
    "let_go",
    "lock_id",
    "seat_connection",
    "take_seat",
]

#: Seats there are: relays beyond this many run without one and take from every key.
SEATS = 64


def enabled(using: str) -> bool:
    """Whether relays on this database hold presence locks."""
    return conf.TAKE_OVER_DEAD_OWNERS and connections[using].vendor in ("postgresql", "mysql")


def lock_id(token: uuid.UUID) -> int:
    """The id of a batch's relay lock on PostgreSQL (the second key of the two-integer form)."""
    return int.from_bytes(token.bytes[:4], "big", signed=True)


def _lock_name(token: uuid.UUID) -> str:
    return f"outbox-relay:{token.hex}"


def _execute(using: str, token: uuid.UUID, on_postgresql: str, on_mysql: str) -> None:
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(on_postgresql, [lock_id(token)])
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
            by_id = {lock_id(token): token for token in tokens}
            cursor.execute(postgresql.RELAYS_GONE, [list(by_id)])
            return {by_id[row[0]] for row in cursor.fetchall()}
        ordered = list(tokens)
        cursor.execute(mysql.relays_gone(len(ordered)), [_lock_name(t) for t in ordered])
        free = cursor.fetchone()
        return {token for token, is_free in zip(ordered, free, strict=True) if is_free}


# --- seats -------------------------------------------------------------------------------------


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
