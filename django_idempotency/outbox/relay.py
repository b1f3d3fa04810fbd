"""Layer 3, sending side: claim a batch, publish it with no transaction open, acknowledge it.

Locking and ordering, in one place:

* **Claim**. ``SELECT ... FOR UPDATE SKIP LOCKED`` where the database has it (PostgreSQL,
  MariaDB 10.6+, MySQL 8), so relays running side by side take disjoint batches instead of
  queueing on each other's rows; SQLite serialises writers anyway. The claim commits a lease
  (``locked_until``) and this relay's ``relay_token``: the rows are then owned without any lock
  being held. On PostgreSQL it is one statement in one round trip, the batch's relay lock
  taken inside it (``db.postgresql.outbox_claim_statement``); elsewhere one short transaction
  of several statements.
* **Publish** with no transaction open: network I/O never holds a lock or a snapshot.
* **Ack**, every change fenced on ``relay_token``: a relay whose lease ran out, and whose events
  another relay has claimed since, changes nothing. The events were then published twice with
  the same ``event_id``, which consumers deduplicate. On PostgreSQL one statement, the relay
  lock let go inside it (``db.postgresql.outbox_ack_statement``); elsewhere one short
  transaction, the lock let go after it.

Order: events with the same ``key`` leave in id order (``RELAY_ORDER``, whose first column is
always 0). An event is only claimed when no earlier unpublished event with its key exists outside
the batch, and inside a batch a key's events go out one wave at a time, so a failure holds back
the rest of that key (and only that key) until the failed event is published. Id order is commit
order for a key because ``publish()`` makes same-key publishers take turns (see publish.py): once
an event is visible here, every earlier event of its key that will ever commit has committed, so
passing over none of them keeps the order. No event waits for transactions that publish other
keys, or for a long transaction elsewhere in the database.

Time: leases and backoffs are measured by the database's clock, the one clock every relay
shares, so relays whose own clocks disagree never both hold an event. A pass reads the
database's time once, with its claim (on PostgreSQL the claim statement judges by its own time
and returns it, so without a round trip of its own), and carries it forward on the monotonic
clock.

Outages: a relay whose batch is published but whose ack cannot commit (the database went away
meanwhile) keeps the outcomes and records them first thing when the database answers again,
before it claims anything, so a database restart costs its duration, not a lease. While a batch
is being published a thread renews its lease (a third of the lease at a time), so the lease can
be short: it only matters for a relay that is alive but cannot reach the database, or that is
gone on a backend without session locks. A relay that is gone is found sooner on PostgreSQL and
MariaDB: each batch holds a session lock (see db/session_locks.py), and between batches a relay
releases the batches at the head of the outbox whose lock nobody holds.

MariaDB's own default is REPEATABLE READ (Django's MySQL backend asks for READ COMMITTED unless
``OPTIONS["isolation_level"]`` says otherwise). Under REPEATABLE READ a snapshot lives as long as
its transaction, so nothing here keeps one: each claim and each ack is a new short transaction,
the claim's locking read sees the latest committed rows whatever the level, the relay refuses to
run inside an outer transaction, and the polling loop calls ``close_old_connections()``. The
gap locks REPEATABLE READ adds to the claim's scan last only for that short transaction.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.db import (
    DatabaseError,
    close_old_connections,
    connections,
    router,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BigIntegerField, Exists, F, Field, Func, OuterRef, Q, QuerySet
from django.db.models.expressions import RawSQL
from django.db.models.functions import Mod, Now
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.core.failures import (
    FailureKind,
    describe,
    failure_fingerprint,
    failure_kind,
    failure_traceback,
)
from django_idempotency.db import (
    database_now,
    dialect,
    postgresql,
    prepared,
    rows,
    session_locks,
    to_datetime,
)
from django_idempotency.db.querysets import (
    UNPUBLISHED,
    BeforeInRelayOrder,
    Moment,
    OutboxEventQuerySet,
    OutboxStatus,
    backing_off_q,
    lease_free_q,
)
from django_idempotency.exceptions import (
    IdempotencyConfigurationError,
    OutboxError,
)
from django_idempotency.models import OutboxEvent
from django_idempotency.observability import tracing
from django_idempotency.outbox.publish import NOTIFY_CHANNEL
from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.publishers.routing import PublisherSet, resolve_route

__all__ = [
    "DatabaseClock",
    "REFUSED_ROUTE_SECONDS",
    "Relay",
    "RelayStats",
    "RouteFailure",
    "SEND_SPAN",
    "backoff_delay",
]

logger = logging.getLogger(__name__)

#: Share of the lease a batch may spend publishing before it stops and releases the rest.
_LEASE_BUDGET = 0.8
#: The PRODUCER span around each batch handed to a publisher, linked to the publishing spans.
SEND_SPAN = "outbox.publish"
#: How often (seconds) a relay looks for batches held by relays that are gone.
_LOOK_FOR_GONE_RELAYS_SECONDS = 1.0
#: How many events at the head of the outbox that look covers: a gone relay's batch sinks to the
#: head as the live relays publish what follows it.
_HEAD_OF_OUTBOX = 1000
#: A polling relay's wait after a pass that found events; it doubles while passes find none.
_FIRST_POLL_SECONDS = 0.05
#: Seconds between attempts when the database is unreachable (the poll may be far longer).
_DATABASE_RETRY_SECONDS = 1.0
#: After a route's broker refused it (a configuration error), the relay fails that route's
#: retried events for this long without asking the broker again: however large the backlog
#: that comes due, a relay presents wrong credentials at most once a minute. New events, and
#: events an operator retried, are always tried.
REFUSED_ROUTE_SECONDS = 60.0


@dataclass(slots=True)
class RelayStats:
    """What a pass (or several) did. ``released``: claimed but not sent (the lease was running
    short, or an earlier event with the same key failed). ``lost``: published, but the lease
    was taken over meanwhile, so another relay sends them again. ``recorded_late``: outcomes
    kept through a database outage and recorded once it was back. ``reclaimed``: events
    released from the batches of relays that are gone."""

    claimed: int = 0
    published: int = 0
    failed: int = 0
    dead: int = 0
    released: int = 0
    lost: int = 0
    recorded_late: int = 0
    reclaimed: int = 0

    def add(self, other: RelayStats) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class RouteFailure:
    """Events of one route (``OUTBOX_PUBLISHERS`` pattern) that failed, and the last cause: what
    an operator needs to know which broker is down and why."""

    route: str
    publisher: str
    cause: str
    failed: int = 0
    dead: int = 0

    def __str__(self) -> str:
        count = self.failed + self.dead
        events = f"{count} event{'s' if count != 1 else ''}"
        dead = f" ({self.dead} now DEAD)" if self.dead else ""
        via = f" ({self.publisher})" if self.publisher else ""
        return f"{self.route}{via}: {events}{dead}, {self.cause}"


@dataclass(frozen=True, slots=True)
class DatabaseClock:
    """The database's time, read once and carried forward on this process's monotonic clock.

    Every relay compares and sets leases (``locked_until``) and backoffs (``next_attempt_at``)
    by it rather than by its own wall clock, so relays on machines whose clocks disagree by
    minutes still never hold one event at once. The monotonic clock only measures the seconds
    since the reading, which no clock setting moves.
    """

    read_at: datetime
    monotonic: float

    @classmethod
    def read(cls, connection: BaseDatabaseWrapper) -> DatabaseClock:
        """Read the database's time, in a statement of its own. (The claim on PostgreSQL needs
        none: its one statement returns the time with the batch.)"""
        if connection.vendor in ("postgresql", "mysql"):
            now = database_now(connection.alias)
        else:
            # SQLite: the machine's clock is the database's (see db/sqlite.py). Other backends
            # have no statement here yet, and need their relays' clocks to agree.
            now = timezone.now()
        return cls(read_at=now, monotonic=time.monotonic())

    def now(self) -> datetime:
        return self.read_at + timedelta(seconds=time.monotonic() - self.monotonic)


def backoff_delay(attempts: int, rng: random.Random | None = None) -> float:
    """Seconds before retry number ``attempts``: exponential with full jitter.

    Uniform over ``[0, min(max, base * 2 ** (attempts - 1))]``, so relays retrying a broker that
    just came back spread out instead of arriving together.
    """
    ceiling = min(
        conf.OUTBOX_BACKOFF_MAX_SECONDS,
        conf.OUTBOX_BACKOFF_BASE_SECONDS * 2 ** min(max(attempts - 1, 0), 62),
    )
    return (rng or random).uniform(0, ceiling)


class Relay:
    """Publishes due outbox events. Build one per process or thread and reuse it: it keeps its
    publishers (and their broker connections) between passes.

    ``share_keys``: take a seat among the relays and claim only this relay's share of the keys
    (see db/session_locks.py). :meth:`run_forever` turns it on; a relay that only drains once (the
    on-commit kick, the Celery task, a test) claims from every key and opens no connection for a
    seat.

    ``only``: a ``Q`` on ``OutboxEvent``; the relay then acts as if the outbox held only the
    events it matches. It claims no other event, and no other event holds its events back, so
    the order per key holds among those events alone: for a tool that relays events of its own
    (``idempotency_verify``'s scratch events), never to split a project's outbox between relays.
    """

    def __init__(
        self,
        *,
        using: str | None = None,
        batch_size: int | None = None,
        lease_seconds: float | None = None,
        rng: random.Random | None = None,
        allow_in_transaction: bool = False,
        share_keys: bool = False,
        only: Q | None = None,
    ) -> None:
        self.using = using or router.db_for_write(OutboxEvent)
        self.batch_size = batch_size or conf.OUTBOX_BATCH_SIZE
        self.lease_seconds = lease_seconds or conf.OUTBOX_RELAY_LEASE_SECONDS
        self.rng = rng or random.Random()
        self.allow_in_transaction = allow_in_transaction
        self.share_keys = share_keys
        self.only = only
        self.publishers = PublisherSet()
        self._publisher_names: dict[int, str] = {}
        #: Routes whose broker refused them lately: until when, and the refusal.
        self._refused: dict[Publisher, tuple[float, BaseException]] = {}
        #: The routes whose events failed since this relay was made, by route (see failures()).
        self._route_failures: dict[str, RouteFailure] = {}
        #: A published batch whose outcomes the database could not take yet.
        self._unrecorded: _Outcomes | None = None
        self._next_look_for_gone_relays = 0.0
        #: This relay's seat among the relays (see db/session_locks.py), looked at once a second,
        #: and the connection of its own that holds it.
        self._seat: session_locks.Seat | None = None
        self._seat_connection: BaseDatabaseWrapper | None = None
        self._next_look_at_seat = 0.0

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.publishers.close()
        self._leave_seat()

    def failures(self) -> list[RouteFailure]:
        """Each route whose events failed since this relay was made, with the last cause."""
        return list(self._route_failures.values())

    def _count_failure(self, event: OutboxEvent, error: BaseException, dead: bool) -> None:
        try:
            route = f"route {resolve_route(event.topic).pattern!r}"
        except IdempotencyConfigurationError:  # no pattern matches its topic, or a bad route
            route = f"topic {event.topic!r} (no route)"
        publisher = self._publisher_names.pop(event.pk, "")
        failure = self._route_failures.setdefault(route, RouteFailure(route, publisher, ""))
        failure.publisher = publisher or failure.publisher
        failure.cause = _describe(error)
        if dead:
            failure.dead += 1
        else:
            failure.failed += 1

    def _leave_seat(self) -> None:
        seat_connection, self._seat_connection, self._seat = self._seat_connection, None, None
        if seat_connection is not None:
            with contextlib.suppress(DatabaseError):
                seat_connection.close()  # the session ends, and its seat with it

    # --- passes -------------------------------------------------------------------------------

    def run_once(self) -> RelayStats:
        """One batch: claim, publish, acknowledge. Outcomes kept from an earlier pass that the
        database could not take are recorded first; a ``DatabaseError`` means they still are
        not, and the next pass tries again."""
        connection = connections[self.using]
        if connection.in_atomic_block and not self.allow_in_transaction:
            raise OutboxError(
                "The relay publishes over the network and must not run inside "
                "transaction.atomic(): a lock or snapshot would be held across the I/O. Call "
                "it outside the transaction (in tests, use the outbox_relay fixture)."
            )
        stats = self._record_unrecorded()
        stats.reclaimed += self._release_batches_of_gone_relays()
        self._look_at_seat()
        events, clock = self._claim()
        if not events:
            return stats
        deadline = time.monotonic() + self.lease_seconds * _LEASE_BUDGET
        self._publisher_names.clear()
        with _LeaseRenewal(self, events[0].relay_token, clock):
            outcomes = self._publish(events, deadline)
        try:
            stats.add(self._ack(events, outcomes, clock))
        except DatabaseError:
            self._unrecorded = _Outcomes(events, outcomes, clock, time.monotonic())
            raise
        return stats

    def _record_unrecorded(self) -> RelayStats:
        kept = self._unrecorded
        if kept is None:
            return RelayStats()
        stats = self._ack(kept.events, kept.outcomes, kept.clock)
        self._unrecorded = None
        stats.recorded_late = len(kept.outcomes)
        logger.warning(
            "outbox relay recorded the outcomes of %d events %.1f s late, once the database "
            "was back (%d published, %d failed, %d lost to another relay)",
            stats.recorded_late,
            time.monotonic() - kept.kept_at,
            stats.published,
            stats.failed + stats.dead,
            stats.lost,
            extra={"outbox_recorded_late": stats.recorded_late},
        )
        return stats

    def _release_batches_of_gone_relays(self) -> int:
        """Release the leases, at the head of the outbox, of batches whose relay is gone."""
        if not session_locks.enabled(self.using):
            return 0
        if time.monotonic() < self._next_look_for_gone_relays:
            return 0
        self._next_look_for_gone_relays = time.monotonic() + _LOOK_FOR_GONE_RELAYS_SECONDS
        head = self._events().filter(status=OutboxStatus.PENDING).in_relay_order()
        tokens = {
            token
            for token in head.values_list("relay_token", flat=True)[:_HEAD_OF_OUTBOX]
            if token is not None
        }
        gone = session_locks.batches_gone(self.using, tokens)
        if not gone:
            return 0
        released = (
            self._events()
            .filter(relay_token__in=gone, status=OutboxStatus.PENDING)
            .update(locked_until=None, relay_token=None)
        )
        if released:
            logger.warning(
                "outbox relay released %d events leased by %d relays that are gone",
                released,
                len(gone),
                extra={"outbox_reclaimed": released},
            )
        return released

    def _look_at_seat(self) -> None:
        """Hold a seat among the relays, and learn how many there are (at most once a second)."""
        if not (self.share_keys and session_locks.enabled(self.using)):
            return
        if time.monotonic() < self._next_look_at_seat:
            return
        self._next_look_at_seat = time.monotonic() + _LOOK_FOR_GONE_RELAYS_SECONDS
        if self._seat_connection is None:
            self._seat_connection = session_locks.seat_connection(self.using)
        try:
            self._seat = session_locks.take_seat(self._seat_connection)
        except DatabaseError:
            self._leave_seat()  # a new connection, and a seat on it, at the next look
            raise

    def drain(self, max_batches: int | None = None) -> RelayStats:
        """Passes until nothing is due (or ``max_batches``)."""
        total = RelayStats()
        batches = 0
        while max_batches is None or batches < max_batches:
            stats = self.run_once()
            batches += 1
            total.add(stats)
            if not stats.claimed:
                break
        return total

    def run_forever(
        self,
        stop: threading.Event | None = None,
        *,
        poll_seconds: float | None = None,
        on_pass: Callable[[RelayStats], None] | None = None,
    ) -> None:
        """Relay until ``stop`` is set: wake on NOTIFY (PostgreSQL) or every ``poll_seconds``."""
        stop = stop or threading.Event()
        self.share_keys = True  # running for good: one of the fleet
        poll = conf.OUTBOX_POLL_SECONDS if poll_seconds is None else poll_seconds
        with _waiter(self.using) as wait:
            while not stop.is_set():
                # Drops connections that broke or outlived CONN_MAX_AGE; every pass then starts
                # new short transactions, so none reads an old snapshot.
                close_old_connections()
                try:
                    stats = self.run_once()
                except DatabaseError:
                    logger.warning("outbox relay pass failed; retrying", exc_info=True)
                    # The database, not the outbox, decides when to try again: come back soon.
                    stop.wait(min(poll, _DATABASE_RETRY_SECONDS))
                    continue
                if on_pass is not None:
                    on_pass(stats)
                if stats.claimed < self.batch_size:
                    wait(poll, stop, stats.claimed > 0)
        self._give_up_unrecorded()

    def _give_up_unrecorded(self) -> None:
        """On the way out: one last try to record kept outcomes, else say what happens to them."""
        if self._unrecorded is None:
            return
        close_old_connections()
        try:
            self._record_unrecorded()
        except DatabaseError:
            count = len(self._unrecorded.outcomes)
            self._unrecorded = None
            logger.error(
                "outbox relay stops with the outcomes of %d published events unrecorded: they "
                "are published again, with the same event ids, once their lease ends",
                count,
                extra={"outbox_unrecorded": count},
            )

    # --- claim --------------------------------------------------------------------------------

    def _events(self) -> OutboxEventQuerySet:
        """The events this relay sees: the whole outbox, or those ``only`` matches."""
        events = OutboxEvent.objects.using(self.using)
        return events.all() if self.only is None else events.filter(self.only)

    def _candidates(self, now: Moment) -> OutboxEventQuerySet:
        """Due events in relay order that no earlier event with their key holds back."""
        events = self._events()
        same_key = events.filter(key=OuterRef("key"))
        earlier = same_key.filter(BeforeInRelayOrder(OuterRef("transaction_id"), OuterRef("pk")))
        # An earlier event that this very claim could take does not block: it sorts first and
        # lands in the same batch. One that is DEAD, backing off or leased elsewhere does.
        blocked = Exists(earlier.filter(status=OutboxStatus.DEAD)) | Exists(
            earlier.filter(status=OutboxStatus.PENDING).filter(
                backing_off_q(now) | Q(locked_until__gt=now)
            )
        )
        return events.due(now).filter(Q(key="") | ~blocked).in_relay_order()

    def _claim(self) -> tuple[list[OutboxEvent], DatabaseClock]:
        """A batch of due events, leased to this relay under a new token, in relay order, and
        the database's time to measure the rest of the pass by."""
        if connections[self.using].vendor == "postgresql":
            return self._claim_in_one_statement()
        return self._claim_in_a_transaction()

    def _claim_in_one_statement(self) -> tuple[list[OutboxEvent], DatabaseClock]:
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
        now = Now()
        candidates = self._candidates(now)
        fallback: postgresql.Fragment | None = None
        seat = self._seat
        if seat is not None and seat.fleet > 1:
            # As in the portable claim: this relay's share of the keys, and only when it keeps
            # nothing there, what any relay has left waiting for a whole lease.
            fallback = self._compile(candidates.filter(self._left_waiting(now)))
            candidates = self._share(candidates, seat)
        token = uuid.uuid4()
        statement, params = postgresql.outbox_claim_statement(
            rows.quoted_table(connection, OutboxEvent),
            functools.partial(rows.quoted_column, connection, OutboxEvent),
            candidates=self._compile(candidates),
            outsiders=self._outsiders,
            fallback=fallback,
            returned=[
                rows.quoted_column(connection, OutboxEvent, field)
                for field in rows.concrete_fields(OutboxEvent)
            ],
            pending=OutboxStatus.PENDING,
            relay_lock=session_locks.lock_id(token) if session_locks.enabled(self.using) else None,
            lease_seconds=self.lease_seconds,
            token=token,
        )
        found = postgresql.fetch_outbox_claim(connection, statement, params)
        read_at, held = found[0][0], found[0][1]
        clock = DatabaseClock(read_at=to_datetime(read_at), monotonic=time.monotonic())
        events = [
            rows.from_row(OutboxEvent, self.using, row[2:]) for row in found if row[2] is not None
        ]
        if held and not events:
            # Nothing was left to lease once the lock was taken (the fence found every row
            # changed): let go of the lock of a batch that does not exist.
            with contextlib.suppress(DatabaseError):
                session_locks.let_go_of_batch(self.using, token)
        return events, clock

    def _compile(self, candidates: OutboxEventQuerySet) -> postgresql.Fragment:
        """One batch of ``candidates`` (id, key and position) as SQL and its parameters."""
        return self._sql(candidates.values_list("pk", "key", "transaction_id")[: self.batch_size])

    def _outsiders(self, batch: str) -> postgresql.Fragment:
        """``_without_outsiders`` for the claim statement: the earlier unpublished events of the
        candidate's key outside ``batch`` (the statement's names for them, see
        ``db.postgresql.outbox_claim_statement``)."""

        def candidate(name: str) -> RawSQL:
            return RawSQL(f"{postgresql.CLAIM_CANDIDATE}.{name}", [])

        outsider = (
            self._events()
            .filter(key=candidate("key"), status__in=UNPUBLISHED)
            .filter(BeforeInRelayOrder(candidate("transaction_id"), candidate("id")))
            .exclude(pk__in=RawSQL(f"SELECT id FROM {batch}", []))
        )
        return self._sql(outsider.values_list("pk"))

    def _sql(self, queryset: QuerySet[Any, Any]) -> postgresql.Fragment:
        sql, params = queryset.query.get_compiler(using=self.using).as_sql()
        return sql, params

    def _claim_in_a_transaction(self) -> tuple[list[OutboxEvent], DatabaseClock]:
        """MariaDB, MySQL and SQLite: one short transaction of several statements."""
        connection = connections[self.using]
        features = connection.features
        with transaction.atomic(using=self.using):
            # Read inside the transaction: on SQLite after BEGIN has waited for the write lock.
            clock = DatabaseClock.read(connection)
            now = clock.now()
            candidates = self._candidates(now)
            if features.has_select_for_update:
                candidates = candidates.select_for_update(
                    skip_locked=features.has_select_for_update_skip_locked
                )
            seat = self._seat
            if seat is not None and seat.fleet > 1:
                # This relay's share of the keys, so relays never take the heads of the same
                # keys and block each other (see _share); when it has none due, what any other
                # relay has left waiting for a whole lease (that relay hangs, say).
                batch = self._without_outsiders(
                    list(self._share(candidates, seat)[: self.batch_size])
                )
                if not batch:
                    left = candidates.filter(self._left_waiting(now))
                    batch = self._without_outsiders(list(left[: self.batch_size]))
            else:
                batch = self._without_outsiders(list(candidates[: self.batch_size]))
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
            ids = [row.pk for row in batch]
            # Fenced on the lease being free, so even a database without row locks can never
            # hand one event to two relays.
            claimed = (
                self._events()
                .filter(lease_free_q(now), pk__in=ids, status=OutboxStatus.PENDING)
                .update(locked_until=until, relay_token=token)
            )
            if claimed != len(ids):
                batch = list(self._events().filter(relay_token=token).in_relay_order())
        for row in batch:
            row.locked_until, row.relay_token = until, token
        return batch, clock

    def _share(
        self, candidates: OutboxEventQuerySet, seat: session_locks.Seat
    ) -> OutboxEventQuerySet:
        """The candidates whose key hashes to this relay's rank (and those without a key)."""
        key_hash = Func(
            F("key"), function=dialect(self.using).KEY_HASH, output_field=BigIntegerField()
        )
        return candidates.alias(
            relay_share=Mod(key_hash.bitand(0x7FFFFFFF), seat.fleet, output_field=BigIntegerField())
        ).filter(Q(key="") | Q(relay_share=seat.rank))

    def _left_waiting(self, now: Moment) -> Q:
        """Due for at least a lease: written (or last failed) that long ago."""
        since = now - timedelta(seconds=self.lease_seconds)
        return Q(attempts=0, created_at__lte=since) | Q(attempts__gt=0, next_attempt_at__lte=since)

    def _without_outsiders(self, batch: list[OutboxEvent]) -> list[OutboxEvent]:
        """Drop events with an earlier unpublished same-key event outside this batch.

        SKIP LOCKED may have skipped that earlier event because another relay is claiming it
        right now; sending the later one meanwhile would overtake it.
        """
        keyed = [row.pk for row in batch if row.key]
        if not keyed:
            return batch
        ids = [row.pk for row in batch]
        keys = {row.key for row in batch if row.key}
        outsider = (
            self._events()
            .filter(key__in=keys)
            .filter(key=OuterRef("key"), status__in=UNPUBLISHED)
            .exclude(pk__in=ids)
        )
        held = set(
            self._events()
            .filter(pk__in=keyed)
            .filter(
                Exists(
                    outsider.filter(BeforeInRelayOrder(OuterRef("transaction_id"), OuterRef("pk")))
                )
            )
            .values_list("pk", flat=True)
        )
        return [row for row in batch if row.pk not in held]

    # --- publish ------------------------------------------------------------------------------

    def _publish(
        self, events: list[OutboxEvent], deadline: float
    ) -> dict[int, BaseException | None]:
        """Publish in waves of at most one event per key; ``{pk: error or None}`` for each
        event attempted. A key whose event failed sends nothing more in this batch."""
        outcomes: dict[int, BaseException | None] = {}
        failed_keys: set[str] = set()
        remaining = events
        while remaining and time.monotonic() < deadline:
            wave: list[OutboxEvent] = []
            later: list[OutboxEvent] = []
            wave_keys: set[str] = set()
            for event in remaining:
                if event.key in failed_keys:
                    continue
                if event.key in wave_keys:
                    later.append(event)
                    continue
                wave.append(event)
                if event.key:
                    wave_keys.add(event.key)
            for publisher, group in self._by_publisher(wave, outcomes):
                for event in group:
                    self._publisher_names[event.pk] = type(publisher).__name__
                results = self._send_unless_refused(publisher, group)
                for event, error in zip(group, results, strict=True):
                    outcomes[event.pk] = error
                    if error is not None and event.key:
                        failed_keys.add(event.key)
            remaining = later
        return outcomes

    def _by_publisher(
        self, wave: list[OutboxEvent], outcomes: dict[int, BaseException | None]
    ) -> Iterator[tuple[Publisher, list[OutboxEvent]]]:
        groups: dict[int, tuple[Publisher, list[OutboxEvent]]] = {}
        for event in wave:
            try:
                publisher = self.publishers.for_topic(event.topic)
            except Exception as exc:  # unroutable, or a publisher that cannot be built
                outcomes[event.pk] = exc
                continue
            groups.setdefault(id(publisher), (publisher, []))[1].append(event)
        yield from groups.values()

    def _send_unless_refused(
        self, publisher: Publisher, group: list[OutboxEvent]
    ) -> list[BaseException | None]:
        """Send the group, except that while the route's broker refuses it (a configuration
        error within ``REFUSED_ROUTE_SECONDS``), events that failed before fail again with
        that refusal, unsent. A refusal starts the window; a message accepted ends it."""
        refused_until, refusal = self._refused.get(publisher, (0.0, None))
        held = refusal is not None and time.monotonic() < refused_until
        to_send = [event for event in group if not (held and event.attempts)]
        sent = dict(
            zip(
                (event.pk for event in to_send),
                self._send(publisher, to_send) if to_send else [],
                strict=True,
            )
        )
        for error in sent.values():
            if error is None:
                self._refused.pop(publisher, None)
            elif failure_kind(error) == FailureKind.CONFIGURATION:
                self._refused[publisher] = (time.monotonic() + REFUSED_ROUTE_SECONDS, error)
        return [sent.get(event.pk, refusal) for event in group]

    @staticmethod
    def _send(publisher: Publisher, group: list[OutboxEvent]) -> list[BaseException | None]:
        messages = [OutboxMessage.from_event(event) for event in group]
        with tracing.producer_span(
            SEND_SPAN,
            [message.traceparent for message in messages],
            attributes=_send_attributes(publisher, messages),
        ) as span:
            results = _publish_many(publisher, messages)
            if span is not None:
                failures = [error for error in results if error is not None]
                span.set_attribute("outbox.failed", len(failures))
                if failures:
                    tracing.set_error(span, _describe(failures[0]))
        return results

    # --- acknowledge --------------------------------------------------------------------------

    def _ack(
        self,
        events: list[OutboxEvent],
        outcomes: dict[int, BaseException | None],
        clock: DatabaseClock,
    ) -> RelayStats:
        """Record the batch's outcomes where this relay still holds the events, release what
        it did not try, and let go of the batch's lock; signals and logs once that committed.

        Nothing is written on the events in memory until then: a batch whose acknowledgement
        failed is acknowledged again from the same events (see ``_unrecorded``)."""
        now = clock.now()
        token = events[0].relay_token
        sent = [event for event in events if event.pk in outcomes and outcomes[event.pk] is None]
        failures = self._failures(
            [(event, error) for event in events if (error := outcomes.get(event.pk)) is not None],
            now,
        )
        untried = [event.pk for event in events if event.pk not in outcomes]
        if connections[self.using].vendor == "postgresql":
            owned = self._ack_in_one_statement(token, now, sent, failures, untried)
        else:
            owned = self._ack_in_a_transaction(token, now, sent, failures, untried)
        stats = RelayStats(claimed=len(events))
        stats.lost = sum(1 for event in events if event.pk in outcomes and event.pk not in owned)
        stats.released = sum(1 for pk in untried if pk in owned)
        sent = [event for event in sent if event.pk in owned]
        failures = [failure for failure in failures if failure.event.pk in owned]
        for failure in failures:
            for name, value in failure.changes.items():
                setattr(failure.event, name, value)
        self._announce(sent, [(failure.event, failure.error) for failure in failures], stats, now)
        return stats

    def _failures(
        self, failed: list[tuple[OutboxEvent, BaseException]], now: datetime
    ) -> list[_Failure]:
        """What each failure changes: an attempt more, the error and its failure group, and a
        backoff, or DEAD after the last attempt."""
        max_attempts = conf.OUTBOX_MAX_ATTEMPTS
        # A batch often shares one error (a broker outage): describe it once.
        described: dict[int, tuple[str, str, str | None, FailureKind]] = {}
        failures = []
        for event, error in failed:
            if id(error) not in described:
                described[id(error)] = (
                    _describe(error),
                    failure_fingerprint(error),
                    failure_traceback(error) or None,
                    failure_kind(error),
                )
            last_error, fingerprint, traceback, kind = described[id(error)]
            attempts = event.attempts + 1
            status, next_attempt_at = event.status, event.next_attempt_at
            if kind == FailureKind.CONFIGURATION:
                # Refused by the broker, or a route that is wrong: nothing the event did, and
                # nothing a quick retry mends. It waits the backoff's ceiling every time, never
                # dies of it, and goes out once a person fixed the route (or retried it).
                next_attempt_at = now + timedelta(seconds=conf.OUTBOX_BACKOFF_MAX_SECONDS)
            elif attempts >= max_attempts and kind != FailureKind.UNREACHABLE:
                status = OutboxStatus.DEAD
            else:
                # An unreachable broker says nothing about the event either: however long the
                # outage, the event waits for the broker (backoff capped) instead of dying.
                next_attempt_at = now + timedelta(seconds=backoff_delay(attempts, self.rng))
            changes = {
                "status": status,
                "attempts": attempts,
                "next_attempt_at": next_attempt_at,
                "last_error": last_error,
                "failure_fingerprint": fingerprint,
                # The failure group's clock: it restarts when the event fails for a new reason.
                "failing_since": (
                    now
                    if fingerprint != event.failure_fingerprint or event.failing_since is None
                    else event.failing_since
                ),
                "last_failed_at": now,
                "failure_traceback": traceback,
                "failure_kind": kind.value,
            }
            failures.append(_Failure(event, error, changes))
        return failures

    def _ack_in_one_statement(
        self,
        token: uuid.UUID | None,
        now: datetime,
        sent: list[OutboxEvent],
        failures: list[_Failure],
        untried: list[int],
    ) -> set[int]:
        """PostgreSQL: every outcome and the lock's release in one statement, in autocommit
        (``db.postgresql.outbox_ack_statement``); the ids of the events it changed."""
        connection = connections[self.using]
        relay_lock = session_locks.enabled(self.using) and token is not None
        outcome_rows: list[tuple[int, str, dict[str, Any]]] = [
            *((event.pk, postgresql.ACK_SENT, _SENT) for event in sent),
            *((failure.event.pk, postgresql.ACK_FAILED, failure.changes) for failure in failures),
            *((pk, postgresql.ACK_UNTRIED, {}) for pk in untried),
        ]
        params: dict[str, Any] = {
            "id": [pk for pk, _, _ in outcome_rows],
            "kind": [kind for _, kind, _ in outcome_rows],
            "now": now,
            "token": token,
        }
        for name in postgresql.ACK_COLUMNS:
            params[name] = [changes.get(name) for _, _, changes in outcome_rows]
        if relay_lock:
            assert token is not None
            params["relay_lock"] = session_locks.lock_id(token)
        with prepared.cursor(connection) as cursor:
            cursor.execute(_ack_statement(self.using, relay_lock), params)
            changed, _ = cursor.fetchone()
        return set(changed)

    def _ack_in_a_transaction(
        self,
        token: uuid.UUID | None,
        now: datetime,
        sent: list[OutboxEvent],
        failures: list[_Failure],
        untried: list[int],
    ) -> set[int]:
        """MariaDB, MySQL and SQLite: one short transaction of several statements, then the
        lock let go; the ids of the events it changed."""
        mine = self._events().filter(relay_token=token)
        with transaction.atomic(using=self.using):
            batch = [event.pk for event in sent] + [f.event.pk for f in failures] + untried
            owned = set(mine.select_for_update().filter(pk__in=batch).values_list("pk", flat=True))
            if sent_ids := [event.pk for event in sent if event.pk in owned]:
                mine.filter(pk__in=sent_ids).update(
                    **_SENT, published_at=now, locked_until=None, relay_token=None
                )
            for failure in failures:
                if failure.event.pk in owned:
                    mine.filter(pk=failure.event.pk).update(
                        **failure.changes, locked_until=None, relay_token=None
                    )
            if untried:
                mine.filter(pk__in=untried).update(locked_until=None, relay_token=None)
        if session_locks.enabled(self.using) and token is not None:
            # After the commit: until then the batch's rows still carry the token. A lock lost
            # with a broken connection needs no letting go.
            with contextlib.suppress(DatabaseError):
                session_locks.let_go_of_batch(self.using, token)
        return owned

    def _announce(
        self,
        sent: list[OutboxEvent],
        failures: list[tuple[OutboxEvent, BaseException]],
        stats: RelayStats,
        now: datetime,
    ) -> None:
        """Signals and logs, after the ack committed, so receivers see the new state."""
        for event in sent:
            event.status, event.published_at = OutboxStatus.PUBLISHED, now
            event.locked_until = event.relay_token = None
            publisher = self._publisher_names.pop(event.pk, "")
            signals.event_published.send(sender=OutboxEvent, event=event, publisher=publisher)
        stats.published = len(sent)
        for event, error in failures:
            event.locked_until = event.relay_token = None
            dead = event.status == OutboxStatus.DEAD
            extra = _log_extra(event, error)
            self._count_failure(event, error, dead)
            signals.publish_failed.send(
                sender=OutboxEvent,
                event=event,
                error=error,
                attempts=event.attempts,
                next_attempt_at=None if dead else event.next_attempt_at,
            )
            if dead:
                stats.dead += 1
                logger.error("outbox event is DEAD after %d attempts", event.attempts, extra=extra)
                signals.event_dead.send(sender=OutboxEvent, event=event, error=error)
            elif event.failure_kind == FailureKind.CONFIGURATION:
                stats.failed += 1
                logger.error(
                    "outbox publish refused: a configuration error (the route or the broker); "
                    "retrying every %g s",
                    conf.OUTBOX_BACKOFF_MAX_SECONDS,
                    extra=extra,
                )
            else:
                stats.failed += 1
                logger.warning("outbox publish failed; will retry", extra=extra)
        if stats.lost:
            logger.warning(
                "outbox relay lost its lease on %d published events; another relay resends "
                "them with the same event ids",
                stats.lost,
                extra={"outbox_lost": stats.lost},
            )


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed event, its error, and the columns its acknowledgement sets (by field name)."""

    event: OutboxEvent
    error: BaseException
    changes: dict[str, Any]


#: What the acknowledgement sets on a published event besides ``published_at``.
_SENT: dict[str, Any] = {
    "status": OutboxStatus.PUBLISHED,
    "last_error": "",
    "failure_fingerprint": None,
    "failing_since": None,
    "failure_traceback": None,
    "failure_kind": None,
}


@functools.lru_cache(maxsize=16)
def _ack_statement(using: str, relay_lock: bool) -> str:
    """The acknowledgement's text: it depends only on the connection, so it is built once."""
    connection = connections[using]
    types = {
        name: str(_outbox_field(name).cast_db_type(connection))
        for name in ("id", "published_at", *postgresql.ACK_COLUMNS)
    }
    return postgresql.outbox_ack_statement(
        rows.quoted_table(connection, OutboxEvent),
        functools.partial(rows.quoted_column, connection, OutboxEvent),
        types,
        relay_lock=relay_lock,
    )


def _outbox_field(name: str) -> Field[Any, Any]:
    return cast("Field[Any, Any]", OutboxEvent._meta.get_field(name))


@dataclass(frozen=True, slots=True)
class _Outcomes:
    """A published batch's outcomes, kept while the database cannot take them."""

    events: list[OutboxEvent]
    outcomes: dict[int, BaseException | None]
    clock: DatabaseClock
    kept_at: float


class _LeaseRenewal:
    """Renews a batch's lease from a thread while the batch is published, so the lease can be
    short without cutting a slow batch. The thread has its own connection (Django's are per
    thread); its updates are fenced on the batch's token, so a batch that was taken over is
    left alone. Nothing is renewed while the relay runs inside an outer transaction (tests):
    its claim is not visible to another connection then."""

    def __init__(self, relay: Relay, token: uuid.UUID | None, clock: DatabaseClock) -> None:
        self.relay, self.token, self.clock = relay, token, clock
        self.interval = relay.lease_seconds / 3
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _LeaseRenewal:
        if self.token is not None and not connections[self.relay.using].in_atomic_block:
            self._thread = threading.Thread(
                target=self._renew, name="outbox-lease-renewal", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _renew(self) -> None:
        try:
            while not self._stopped.wait(self.interval):
                until = self.clock.now() + timedelta(seconds=self.relay.lease_seconds)
                try:
                    renewed = (
                        self.relay._events()
                        .filter(relay_token=self.token, status=OutboxStatus.PENDING)
                        .update(locked_until=until)
                    )
                except DatabaseError:
                    logger.warning("outbox relay could not renew its lease", exc_info=True)
                    continue
                if not renewed:
                    return
        finally:
            connections[self.relay.using].close()


def _publish_many(
    publisher: Publisher, messages: list[OutboxMessage]
) -> list[BaseException | None]:
    try:
        results = list(publisher.publish_many(messages))
    except Exception as exc:
        return [exc] * len(messages)
    if len(results) != len(messages):
        error = OutboxError(f"{type(publisher).__name__}.publish_many returned a wrong count")
        return [error] * len(messages)
    return results


def _send_attributes(
    publisher: Publisher, messages: list[OutboxMessage]
) -> dict[str, tracing.AttributeValue]:
    attributes: dict[str, tracing.AttributeValue] = {
        "messaging.operation.type": "send",
        "messaging.batch.message_count": len(messages),
        "outbox.publisher": type(publisher).__name__,
    }
    topics = {message.topic for message in messages}
    if len(topics) == 1:
        attributes["messaging.destination.name"] = topics.pop()
    return attributes


def _describe(error: BaseException) -> str:
    return describe(error)


def _log_extra(event: OutboxEvent, error: BaseException) -> dict[str, Any]:
    return {
        "outbox_event_id": str(event.event_id),
        "outbox_topic": event.topic,
        "outbox_attempts": event.attempts,
        "outbox_error": _describe(error),
        "outbox_failure_kind": failure_kind(error).value,
    }


# --- waiting between passes --------------------------------------------------------------------

_Wait = Callable[[float, threading.Event, bool], None]


class _waiter:  # noqa: N801  (used as a context manager, like contextlib's)
    """Sleep until the next pass: on PostgreSQL with psycopg 3, LISTEN on a connection of its
    own and wake at the first NOTIFY from a publishing commit; elsewhere, just the poll.

    A LISTEN connection that breaks (a database restart) is made again at the next wait that
    finds the database answering, and that wait returns at once: commits made while nobody
    listened sent their NOTIFY to no one, so a pass looks for their events.

    Polling (no LISTEN) backs off: after a pass that found events the next comes 50 ms later,
    and each pass that finds nothing doubles the wait, up to the poll, so a relay that has just
    been busy sees the next commit within tens of milliseconds and an idle one costs little."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.listener: Any = None
        self.wanted = False
        self.idle_wait = _FIRST_POLL_SECONDS

    def __enter__(self) -> _Wait:
        connection = connections[self.using]
        if conf.OUTBOX_NOTIFY and connection.vendor == "postgresql":
            self.wanted = True
            try:
                self.listener = self._listen()
            except Exception:
                logger.warning("outbox relay cannot LISTEN; polling instead", exc_info=True)
        return self.wait

    def _listen(self) -> Any:
        connection = connections[self.using]
        raw = connection.get_new_connection(connection.get_connection_params())
        if not hasattr(raw, "notifies"):  # psycopg2: no blocking notifies() API; poll instead
            self.wanted = False
            raw.close()
            return None
        raw.autocommit = True
        raw.execute(f"LISTEN {NOTIFY_CHANNEL}")
        return raw

    def wait(self, timeout: float, stop: threading.Event, busy: bool = False) -> None:
        if self.listener is None and self.wanted:
            try:
                self.listener = self._listen()
            except Exception:
                logger.debug("outbox relay cannot LISTEN yet", exc_info=True)
            else:
                if self.listener is not None:
                    logger.warning("outbox relay is listening for commits again")
                    return
        if self.listener is None:
            if busy:
                self.idle_wait = _FIRST_POLL_SECONDS
            stop.wait(min(timeout, self.idle_wait))
            self.idle_wait = min(timeout, self.idle_wait * 2)
            return
        deadline = time.monotonic() + timeout
        try:
            # Short slices so a set ``stop`` is noticed within a second.
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                for _ in self.listener.notifies(timeout=min(left, 1.0), stop_after=1):
                    return
        except Exception:
            logger.warning(
                "outbox relay lost its LISTEN connection; polling until it is back",
                exc_info=True,
            )
            self._close()

    def _close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            with contextlib.suppress(Exception):  # already broken
                listener.close()

    def __exit__(self, *exc: object) -> None:
        self.wanted = False
        self._close()
