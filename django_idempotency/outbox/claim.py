"""Claim a batch: due events, in relay order, that no earlier event of their key holds back,
leased to one relay under a new token.

``SELECT ... FOR UPDATE SKIP LOCKED`` where the database has it (PostgreSQL, MariaDB 10.6+,
MySQL 8), so relays running side by side take disjoint batches instead of queueing on each
other's rows; SQLite serialises writers anyway. The claim commits a lease (``locked_until``) and
the relay's ``relay_token``: the rows are then owned without any lock being held. On PostgreSQL
it is one statement in one round trip, the batch's relay lock taken inside it
(``db.postgresql.outbox_claim_statement``); elsewhere one short transaction of several
statements.

Order: an event is only claimed when no earlier unpublished event with its key exists outside
the batch. Id order is commit order for a key (``publish()`` makes same-key publishers take
turns), so passing over none of them keeps the order.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import BigIntegerField, F, Field, Func, JSONField, OuterRef, Q, QuerySet
from django.db.models.expressions import Expression, RawSQL
from django.db.models.functions import Mod, Now

from django_idempotency.db import dialect, postgresql, rows, session_locks, to_datetime
from django_idempotency.db.querysets import (
    UNPUBLISHED,
    Moment,
    OutboxEventQuerySet,
    OutboxStatus,
    backing_off_q,
    earlier_unpublished,
    lease_free_q,
)
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.clock import DatabaseClock

__all__ = ["claim_batch"]


#: A claim statement with stand-ins for what changes per claim, by what shapes it.
Statements = dict[tuple[Any, ...], tuple[str, list[Any]]]


class _Slot(enum.Enum):
    """Where a cached claim statement takes this claim's values."""

    TOKEN = "token"
    LOCK = "lock"
    PUBLISHED_THROUGH = "published_through"


class _Parameter(Expression):
    """A statement parameter passed as it is: a :class:`_Slot` of a cached statement."""

    def __init__(self, value: object, output_field: Field[Any, Any]) -> None:
        super().__init__(output_field=output_field)
        self.value = value

    def as_sql(self, compiler: Any, connection: Any) -> Any:
        return "%s", [self.value]


def published_through(key: Any) -> Func:
    """PostgreSQL: the id through which the relay has published ``key``'s events itself, from
    the claim's :data:`_Slot.PUBLISHED_THROUGH` (a JSON object of key to id), else 0.

    Every event of the key up to that id is PUBLISHED for good: the relay sent it after every
    earlier event of its key (the order this claim keeps), nothing in the library makes a
    published event unpublished again, and no earlier id of the key can commit later
    (``publish()``). So the per-key checks need not read below it, where the key's published
    events left dead index entries that only a vacuum removes: with autovacuum off, halfway
    through a million-event backlog, each check read 38 buffers instead of 4."""
    return Func(
        _Parameter(_Slot.PUBLISHED_THROUGH, JSONField()),
        key,
        template="COALESCE((%(expressions)s)::bigint, 0)",
        arg_joiner="::jsonb ->> ",
        output_field=BigIntegerField(),
    )


def claim_batch(
    outbox: OutboxEventQuerySet,
    *,
    batch_size: int,
    lease_seconds: float,
    seat: session_locks.Seat | None,
    statements: Statements | None = None,
    published: Mapping[str, int] | None = None,
) -> tuple[list[OutboxEvent], DatabaseClock]:
    """A batch of due events of ``outbox`` (the events a relay sees), leased under a new
    token, in relay order, and the database's time to measure the rest of the pass by. With a
    ``seat`` among several relays, only that seat's share of the keys. ``statements``: where
    the caller keeps the claim statements built for ``outbox`` (PostgreSQL), across claims.
    ``published``: by key, the highest id the caller has published itself (PostgreSQL, see
    :func:`published_through`)."""
    claim = _Claim(outbox, outbox.db, batch_size, lease_seconds, seat, statements, published)
    if connections[claim.using].vendor == "postgresql":
        return claim.in_one_statement()
    return claim.in_a_transaction()


@dataclass(frozen=True, slots=True)
class _Claim:
    outbox: OutboxEventQuerySet
    using: str
    batch_size: int
    lease_seconds: float
    seat: session_locks.Seat | None
    statements: Statements | None
    published: Mapping[str, int] | None

    def candidates(self, now: Moment, *, bounded: bool = False) -> OutboxEventQuerySet:
        """Due events in relay order that no earlier event with their key holds back; with
        ``bounded``, read no earlier event below :func:`published_through`."""
        events = self.outbox
        # An earlier event that this very claim could take does not block: it sorts first and
        # lands in the same batch. One that is DEAD, HELD, backing off or leased elsewhere does.
        # (HELD events themselves are not PENDING, so the scan never reads them: holding.py.) On
        # the key's index range of unpublished events: the planner cannot serve it from an
        # index on the status alone, which reads every DEAD event of the outbox.
        holding = events.filter(key=OuterRef("key"), status__in=UNPUBLISHED).filter(
            Q(status__in=(OutboxStatus.DEAD, OutboxStatus.HELD))
            | backing_off_q(now)
            | Q(locked_until__gt=now)
        )
        if bounded:
            holding = holding.filter(pk__gt=published_through(OuterRef("key")))
        blocked = earlier_unpublished(holding, OuterRef("pk"))
        return events.due(now).filter(Q(key="") | ~blocked).in_relay_order()

    def in_one_statement(self) -> tuple[list[OutboxEvent], DatabaseClock]:
        """PostgreSQL: the whole claim, the batch's relay lock included, in one round trip
        (``db.postgresql.outbox_claim_statement``), in autocommit.

        Time: the statement judges due-ness and leases by its own time, ``STATEMENT_TIMESTAMP()``
        (Django's ``Now()``), and returns the database's time as it ends, from which the
        relay's clock for the rest of the pass is carried forward on the monotonic clock. That
        is the database's clock with no reading of its own, never stale, so nothing has to
        refresh it. (Reusing a clock read on an earlier pass would save nothing more and would
        carry the monotonic clock's drift across passes.)
        """
        connection = connections[self.using]
        token = uuid.uuid4()
        lock = session_locks.lock_id(token) if session_locks.enabled(self.using) else None
        statement, slotted = self.statement(locking=lock is not None)
        slots = {
            _Slot.TOKEN: token,
            _Slot.LOCK: lock,
            _Slot.PUBLISHED_THROUGH: json.dumps(dict(self.published or {})),
        }
        params = [slots[param] if isinstance(param, _Slot) else param for param in slotted]
        found = postgresql.fetch_outbox_claim(connection, statement, params)
        read_at, held = found[0][0], found[0][1]
        clock = DatabaseClock(read_at=to_datetime(read_at), monotonic=time.monotonic())
        events = rows.from_rows(
            OutboxEvent, self.using, (row[2:] for row in found if row[2] is not None)
        )
        if held and not events:
            # Nothing was left to lease once the lock was taken (the fence found every row
            # changed): let go of the lock of a batch that does not exist.
            with contextlib.suppress(DatabaseError):
                session_locks.let_go_of_batch(self.using, token)
        return events, clock

    def statement(self, *, locking: bool) -> tuple[str, list[Any]]:
        """The claim statement, with :class:`_Slot` stand-ins for the token, the relay lock
        and what the relay published. The ORM builds it once per shape (batch, lease, seat)
        and relay: it takes a seventh of a relay's time when built for every claim. Nothing
        else in it changes between claims: its times are the statement's own (``Now()``)."""
        seat = self.seat
        shared = seat if seat is not None and seat.fleet > 1 else None
        share = None if shared is None else (shared.fleet, shared.rank)
        shape = (self.batch_size, self.lease_seconds, share, locking)
        if self.statements is not None and shape in self.statements:
            return self.statements[shape]
        connection = connections[self.using]
        now = Now()
        candidates = self.candidates(now, bounded=True)
        fallback: postgresql.Fragment | None = None
        if shared is not None:
            # As in the portable claim: this relay's share of the keys, and only when it keeps
            # nothing there, what any relay has left waiting for a whole lease.
            fallback = self.compile(candidates.filter(self.left_waiting(now)))
            candidates = self.share(candidates, shared)
        built = postgresql.outbox_claim_statement(
            rows.quoted_table(connection, OutboxEvent),
            functools.partial(rows.quoted_column, connection, OutboxEvent),
            candidates=self.compile(candidates),
            outsiders=self.outsiders,
            fallback=fallback,
            returned=[
                rows.quoted_column(connection, OutboxEvent, field)
                for field in rows.concrete_fields(OutboxEvent)
            ],
            pending=OutboxStatus.PENDING,
            relay_lock=_Slot.LOCK if locking else None,
            lease_seconds=self.lease_seconds,
            token=_Slot.TOKEN,
        )
        if self.statements is not None:
            if len(self.statements) > 64:  # seats come and go: keep only what is in use
                self.statements.clear()
            self.statements[shape] = built
        return built

    def compile(self, candidates: OutboxEventQuerySet) -> postgresql.Fragment:
        """One batch of ``candidates`` (id, key and position) as SQL and its parameters."""
        return self.sql(candidates.values_list("pk", "key", "transaction_id")[: self.batch_size])

    def outsiders(self, batch: str) -> postgresql.Fragment:
        """``without_outsiders`` for the claim statement: the earlier unpublished events of the
        candidate's key outside ``batch`` (the statement's names for them, see
        ``db.postgresql.outbox_claim_statement``)."""

        def candidate(name: str) -> RawSQL:
            return RawSQL(f"{postgresql.CLAIM_CANDIDATE}.{name}", [])

        outsider = self.outbox.filter(
            key=candidate("key"),
            status__in=UNPUBLISHED,
            pk__lt=candidate("id"),
            pk__gt=published_through(candidate("key")),
        ).exclude(pk__in=RawSQL(f"SELECT id FROM {batch}", []))
        return self.sql(outsider.values_list("pk"))

    def sql(self, queryset: QuerySet[Any, Any]) -> postgresql.Fragment:
        sql, params = queryset.query.get_compiler(using=self.using).as_sql()
        return sql, params

    def in_a_transaction(self) -> tuple[list[OutboxEvent], DatabaseClock]:
        """MariaDB, MySQL and SQLite: one short transaction of several statements."""
        connection = connections[self.using]
        features = connection.features
        with transaction.atomic(using=self.using):
            # Read inside the transaction: on SQLite after BEGIN has waited for the write lock.
            clock = DatabaseClock.read(connection)
            now = clock.now()
            candidates = self.candidates(now)
            if features.has_select_for_update:
                candidates = candidates.select_for_update(
                    skip_locked=features.has_select_for_update_skip_locked
                )
            seat = self.seat
            if seat is not None and seat.fleet > 1:
                # This relay's share of the keys, so relays never take the heads of the same
                # keys and block each other (see share); when it has none due, what any other
                # relay has left waiting for a whole lease (that relay hangs, say).
                batch = self.without_outsiders(
                    list(self.share(candidates, seat)[: self.batch_size])
                )
                if not batch:
                    left = candidates.filter(self.left_waiting(now))
                    batch = self.without_outsiders(list(left[: self.batch_size]))
            else:
                batch = self.without_outsiders(list(candidates[: self.batch_size]))
            if not batch:
                return [], clock
            token = uuid.uuid4()
            if session_locks.enabled(self.using):
                # Before the lease commits, so no relay ever sees the batch without its lock.
                session_locks.hold_batch(self.using, token)
            # The lease runs from now, not from ``now``: the claim may have queued for row locks
            # (without SKIP LOCKED), and the publish budget counts from after the claim, so a
            # lease counted from before the wait could run out first.
            until = clock.now() + timedelta(seconds=self.lease_seconds)
            ids = [event.pk for event in batch]
            # Fenced on the lease being free, so even a database without row locks can never
            # hand one event to two relays.
            claimed = self.outbox.filter(
                lease_free_q(now), pk__in=ids, status=OutboxStatus.PENDING
            ).update(locked_until=until, relay_token=token)
            if claimed != len(ids):
                batch = list(self.outbox.filter(relay_token=token).in_relay_order())
        for event in batch:
            event.locked_until, event.relay_token = until, token
        return batch, clock

    def share(
        self, candidates: OutboxEventQuerySet, seat: session_locks.Seat
    ) -> OutboxEventQuerySet:
        """The candidates whose key hashes to this relay's rank (and those without a key)."""
        key_hash = Func(
            F("key"), function=dialect(self.using).KEY_HASH, output_field=BigIntegerField()
        )
        return candidates.alias(
            relay_share=Mod(key_hash.bitand(0x7FFFFFFF), seat.fleet, output_field=BigIntegerField())
        ).filter(Q(key="") | Q(relay_share=seat.rank))

    def left_waiting(self, now: Moment) -> Q:
        """Due for at least a lease: written (or last failed) that long ago."""
        since = now - timedelta(seconds=self.lease_seconds)
        return Q(attempts=0, created_at__lte=since) | Q(attempts__gt=0, next_attempt_at__lte=since)

    def without_outsiders(self, batch: list[OutboxEvent]) -> list[OutboxEvent]:
        """Drop events with an earlier unpublished same-key event outside this batch.

        SKIP LOCKED may have skipped that earlier event because another relay is claiming it
        right now; sending the later one meanwhile would overtake it.
        """
        keyed = [event.pk for event in batch if event.key]
        if not keyed:
            return batch
        ids = [event.pk for event in batch]
        keys = {event.key for event in batch if event.key}
        outsider = (
            self.outbox.filter(key__in=keys)
            .filter(key=OuterRef("key"), status__in=UNPUBLISHED)
            .exclude(pk__in=ids)
        )
        held = set(
            self.outbox.filter(pk__in=keyed)
            .filter(earlier_unpublished(outsider, OuterRef("pk")))
            .values_list("pk", flat=True)
        )
        return [event for event in batch if event.pk not in held]
