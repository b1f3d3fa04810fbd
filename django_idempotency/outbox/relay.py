"""Layer 3, sending side: claim a batch, publish it with no transaction open, acknowledge it.

Locking and ordering, in one place:

* **Claim** (one short transaction). ``SELECT ... FOR UPDATE SKIP LOCKED`` where the database
  has it (PostgreSQL, MariaDB 10.6+, MySQL 8), so relays running side by side take disjoint
  batches instead of queueing on each other's rows; SQLite serialises writers anyway. The claim
  commits a lease (``locked_until``) and this relay's ``relay_token``: the rows are then owned
  without any lock being held.
* **Publish** with no transaction open: network I/O never holds a lock or a snapshot.
* **Ack** (one short transaction), every UPDATE fenced on ``relay_token``: a relay whose lease
  ran out, and whose events another relay has claimed since, changes nothing. The events were
  then published twice with the same ``event_id``, which consumers deduplicate.

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
database's time once, at the start of its claim (on PostgreSQL in the statement that pins the
plan, so without a round trip of its own), and carries it forward on the monotonic clock.

MariaDB's own default is REPEATABLE READ (Django's MySQL backend asks for READ COMMITTED unless
``OPTIONS["isolation_level"]`` says otherwise). Under REPEATABLE READ a snapshot lives as long as
its transaction, so nothing here keeps one: each claim and each ack is a new short transaction,
the claim's locking read sees the latest committed rows whatever the level, the relay refuses to
run inside an outer transaction, and the polling loop calls ``close_old_connections()``. The
gap locks REPEATABLE READ adds to the claim's scan last only for that short transaction.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import (
    DatabaseError,
    close_old_connections,
    connections,
    router,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from django_idempotency import signals, tracing
from django_idempotency.conf import conf
from django_idempotency.core.failures import describe, failure_fingerprint, failure_traceback
from django_idempotency.db import database_now, postgresql
from django_idempotency.exceptions import BrokerUnavailable, OutboxError
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.publish import NOTIFY_CHANNEL
from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.publishers.routing import PublisherSet
from django_idempotency.querysets import (
    UNPUBLISHED,
    OutboxEventQuerySet,
    OutboxStatus,
    backing_off_q,
    earlier_than_q,
    lease_free_q,
)

__all__ = ["DatabaseClock", "Relay", "RelayStats", "SEND_SPAN", "backoff_delay"]

logger = logging.getLogger(__name__)

#: Share of the lease a batch may spend publishing before it stops and releases the rest.
_LEASE_BUDGET = 0.8
#: The PRODUCER span around each batch handed to a publisher, linked to the publishing spans.
SEND_SPAN = "outbox.publish"


@dataclass(slots=True)
class RelayStats:
    """What a pass (or several) did. ``released``: claimed but not sent (the lease was running
    short, or an earlier event with the same key failed). ``lost``: published, but the lease
    was taken over meanwhile, so another relay sends them again."""

    claimed: int = 0
    published: int = 0
    failed: int = 0
    dead: int = 0
    released: int = 0
    lost: int = 0

    def add(self, other: RelayStats) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


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
        """Read the database's time. On PostgreSQL this also pins the claim's plan for the
        current transaction (see ``db.postgresql.begin_outbox_claim``), in the same statement."""
        if connection.vendor == "postgresql":
            now = postgresql.begin_outbox_claim(connection)
        elif connection.vendor == "mysql":
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
    publishers (and their broker connections) between passes."""

    def __init__(
        self,
        *,
        using: str | None = None,
        batch_size: int | None = None,
        lease_seconds: float | None = None,
        rng: random.Random | None = None,
        allow_in_transaction: bool = False,
    ) -> None:
        self.using = using or router.db_for_write(OutboxEvent)
        self.batch_size = batch_size or conf.OUTBOX_BATCH_SIZE
        self.lease_seconds = lease_seconds or conf.OUTBOX_RELAY_LEASE_SECONDS
        self.rng = rng or random.Random()
        self.allow_in_transaction = allow_in_transaction
        self.publishers = PublisherSet()
        self._publisher_names: dict[int, str] = {}

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.publishers.close()

    # --- passes -------------------------------------------------------------------------------

    def run_once(self) -> RelayStats:
        """One batch: claim, publish, acknowledge."""
        connection = connections[self.using]
        if connection.in_atomic_block and not self.allow_in_transaction:
            raise OutboxError(
                "The relay publishes over the network and must not run inside "
                "transaction.atomic(): a lock or snapshot would be held across the I/O. Call "
                "it outside the transaction (in tests, use the outbox_relay fixture)."
            )
        events, clock = self._claim()
        if not events:
            return RelayStats()
        deadline = time.monotonic() + self.lease_seconds * _LEASE_BUDGET
        self._publisher_names.clear()
        outcomes = self._publish(events, deadline)
        return self._ack(events, outcomes, clock)

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
                    stats = RelayStats()
                if on_pass is not None:
                    on_pass(stats)
                if stats.claimed < self.batch_size:
                    wait(poll, stop)

    # --- claim --------------------------------------------------------------------------------

    def _events(self) -> OutboxEventQuerySet:
        return OutboxEvent.objects.using(self.using).all()

    def _candidates(self, now: datetime) -> OutboxEventQuerySet:
        """Due events in relay order that no earlier event with their key holds back."""
        events = self._events()
        same_key_earlier = events.filter(key=OuterRef("key")).filter(
            earlier_than_q(OuterRef("transaction_id"), OuterRef("pk"))
        )
        # An earlier event that this very claim could take does not block: it sorts first and
        # lands in the same batch. One that is DEAD, backing off or leased elsewhere does.
        blocker = same_key_earlier.filter(
            Q(status=OutboxStatus.DEAD)
            | Q(backing_off_q(now), status=OutboxStatus.PENDING)
            | Q(status=OutboxStatus.PENDING, locked_until__gt=now)
        )
        return events.due(now).filter(Q(key="") | ~Exists(blocker)).in_relay_order()

    def _claim(self) -> tuple[list[OutboxEvent], DatabaseClock]:
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
            rows = self._without_outsiders(list(candidates[: self.batch_size]))
            if not rows:
                return [], clock
            token = uuid.uuid4()
            # The lease runs from now, not from ``now``: the claim may have queued for row locks
            # (without SKIP LOCKED), and the publish budget counts from after the claim, so a
            # lease counted from before the wait could run out first.
            until = clock.now() + timedelta(seconds=self.lease_seconds)
            ids = [row.pk for row in rows]
            # Fenced on the lease being free, so even a database without row locks can never
            # hand one event to two relays.
            claimed = (
                self._events()
                .filter(lease_free_q(now), pk__in=ids, status=OutboxStatus.PENDING)
                .update(locked_until=until, relay_token=token)
            )
            if claimed != len(ids):
                rows = list(self._events().filter(relay_token=token).in_relay_order())
        for row in rows:
            row.locked_until, row.relay_token = until, token
        return rows, clock

    def _without_outsiders(self, rows: list[OutboxEvent]) -> list[OutboxEvent]:
        """Drop events with an earlier unpublished same-key event outside this batch.

        SKIP LOCKED may have skipped that earlier event because another relay is claiming it
        right now; sending the later one meanwhile would overtake it.
        """
        keyed = [row.pk for row in rows if row.key]
        if not keyed:
            return rows
        ids = [row.pk for row in rows]
        keys = {row.key for row in rows if row.key}
        outsider = (
            self._events()
            .filter(key__in=keys)
            .filter(key=OuterRef("key"), status__in=UNPUBLISHED)
            .filter(earlier_than_q(OuterRef("transaction_id"), OuterRef("pk")))
            .exclude(pk__in=ids)
        )
        held = set(
            self._events()
            .filter(pk__in=keyed)
            .filter(Exists(outsider))
            .values_list("pk", flat=True)
        )
        return [row for row in rows if row.pk not in held]

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
                for event, error in zip(group, self._send(publisher, group), strict=True):
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
        now = clock.now()
        max_attempts = conf.OUTBOX_MAX_ATTEMPTS
        token = events[0].relay_token
        stats = RelayStats(claimed=len(events))
        sent: list[OutboxEvent] = []
        failures: list[tuple[OutboxEvent, BaseException]] = []
        mine = self._events().filter(relay_token=token)
        with transaction.atomic(using=self.using):
            owned = set(
                mine.select_for_update()
                .filter(pk__in=[event.pk for event in events])
                .values_list("pk", flat=True)
            )
            for event in events:
                if event.pk not in outcomes:
                    continue
                error = outcomes[event.pk]
                if event.pk not in owned:
                    stats.lost += 1
                elif error is None:
                    sent.append(event)
                else:
                    failures.append((event, error))
            if sent:
                mine.filter(pk__in=[event.pk for event in sent]).update(
                    status=OutboxStatus.PUBLISHED,
                    published_at=now,
                    locked_until=None,
                    relay_token=None,
                    last_error="",
                    failure_fingerprint=None,
                    failing_since=None,
                    failure_traceback=None,
                )
            # A batch often shares one error (a broker outage): describe it once.
            described: dict[int, tuple[str, str, str | None]] = {}
            for event, error in failures:
                if id(error) not in described:
                    described[id(error)] = (
                        _describe(error),
                        failure_fingerprint(error),
                        failure_traceback(error) or None,
                    )
                event.attempts += 1
                event.last_error, fingerprint, event.failure_traceback = described[id(error)]
                # The failure group's clock: it restarts when the event fails for a new reason.
                if fingerprint != event.failure_fingerprint or event.failing_since is None:
                    event.failing_since = now
                event.failure_fingerprint = fingerprint
                event.last_failed_at = now
                # An unreachable broker says nothing about the event: however long the outage,
                # the event waits for the broker (backoff capped) instead of dying.
                outage = isinstance(error, BrokerUnavailable)
                if event.attempts >= max_attempts and not outage:
                    event.status = OutboxStatus.DEAD
                else:
                    event.next_attempt_at = now + timedelta(
                        seconds=backoff_delay(event.attempts, self.rng)
                    )
                mine.filter(pk=event.pk).update(
                    status=event.status,
                    attempts=event.attempts,
                    next_attempt_at=event.next_attempt_at,
                    last_error=event.last_error,
                    failure_fingerprint=event.failure_fingerprint,
                    failing_since=event.failing_since,
                    last_failed_at=event.last_failed_at,
                    failure_traceback=event.failure_traceback,
                    locked_until=None,
                    relay_token=None,
                )
            untried = [event.pk for event in events if event.pk not in outcomes]
            if untried:
                stats.released = mine.filter(pk__in=untried).update(
                    locked_until=None, relay_token=None
                )
        self._announce(sent, failures, stats, now)
        return stats

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
    }


# --- waiting between passes --------------------------------------------------------------------

_Wait = Callable[[float, threading.Event], None]


class _waiter:  # noqa: N801  (used as a context manager, like contextlib's)
    """Sleep until the next pass: on PostgreSQL with psycopg 3, LISTEN on a connection of its
    own and wake at the first NOTIFY from a publishing commit; elsewhere, just the poll."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.listener: Any = None

    def __enter__(self) -> _Wait:
        connection = connections[self.using]
        if conf.OUTBOX_NOTIFY and connection.vendor == "postgresql":
            try:
                raw = connection.get_new_connection(connection.get_connection_params())
                raw.autocommit = True
                raw.execute(f"LISTEN {NOTIFY_CHANNEL}")
                if hasattr(raw, "notifies"):
                    self.listener = raw
                else:  # psycopg2: no blocking notifies() API; poll instead
                    raw.close()
            except Exception:
                logger.warning("outbox relay cannot LISTEN; polling instead", exc_info=True)
        return self.wait

    def wait(self, timeout: float, stop: threading.Event) -> None:
        if self.listener is None:
            stop.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        try:
            # Short slices so a set ``stop`` is noticed within a second.
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                for _ in self.listener.notifies(timeout=min(left, 1.0), stop_after=1):
                    return
        except Exception:
            logger.warning("outbox relay lost its LISTEN connection; polling", exc_info=True)
            self.__exit__()

    def __exit__(self, *exc: object) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            with contextlib.suppress(Exception):  # already broken
                listener.close()
