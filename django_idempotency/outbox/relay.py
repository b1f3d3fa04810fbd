"""Layer 3, sending side: the relay, whose passes claim a batch, publish it with no transaction
open, and acknowledge it.

Each step has its module, and the reasoning about locks and order is there:

* **Claim** (claim.py): due events in relay order, ``SKIP LOCKED`` where the database has it,
  leased under a new token in one short transaction (on PostgreSQL one statement).
* **Publish** (send.py) with no transaction open: network I/O never holds a lock or a snapshot.
  A thread renews the batch's lease meanwhile (lease.py).
* **Ack** (ack.py), every change fenced on the batch's token, then the signals and logs
  (announce.py) once it committed.
* **Between passes**: a relay that runs for good holds a seat among the relays and releases the
  batches of relays that are gone (fleet.py). After a pass that claimed events it passes again at
  once; after one that found nothing it sleeps until a commit, another relay's acknowledgement,
  the retry of an event it failed, or its poll (waiting.py), so no relay idles while events it
  could claim wait.

Order: events with the same ``key`` leave in id order (``RELAY_ORDER``, whose first column is
always 0). An event is only claimed when no earlier unpublished event with its key exists outside
the batch, and inside a batch a key's events go out one wave at a time, so a failure holds back
the rest of that key (and only that key) until the failed event is published. Id order is commit
order for a key because ``publish()`` makes same-key publishers take turns (see publish.py): once
an event is visible here, every earlier event of its key that will ever commit has committed, so
passing over none of them keeps the order. No event waits for transactions that publish other
keys, or for a long transaction elsewhere in the database.

Time: leases and backoffs are measured by the database's clock (clock.py), read once a pass with
its claim.

Outages: a relay whose batch is published but whose ack cannot commit (the database went away
meanwhile) keeps the outcomes and records them first thing when the database answers again,
before it claims anything, so a database restart costs its duration, not a lease.

MariaDB's own default is REPEATABLE READ (Django's MySQL backend asks for READ COMMITTED unless
``OPTIONS["isolation_level"]`` says otherwise). Under REPEATABLE READ a snapshot lives as long as
its transaction, so nothing here keeps one: each claim and each ack is a new short transaction,
the claim's locking read sees the latest committed rows whatever the level, the relay refuses to
run inside an outer transaction, and the polling loop calls ``close_old_connections()`` (see
``_between_passes``). The gap locks REPEATABLE READ adds to the claim's scan last only for that
short transaction.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.db import DatabaseError, close_old_connections, connections, router, transaction
from django.db.models import Q

from django_idempotency.conf import conf
from django_idempotency.db.querysets import OutboxEventQuerySet, OutboxStatus
from django_idempotency.exceptions import OutboxError
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.ack import acknowledge
from django_idempotency.outbox.announce import announce
from django_idempotency.outbox.claim import Statements, claim_batch
from django_idempotency.outbox.clock import DatabaseClock
from django_idempotency.outbox.fleet import GoneRelays, Seating
from django_idempotency.outbox.holding import tend
from django_idempotency.outbox.lease import LeaseRenewal
from django_idempotency.outbox.report import RelayStats, RouteFailure, RouteFailures
from django_idempotency.outbox.send import Outcomes, Sender
from django_idempotency.outbox.waiting import waiter

__all__ = ["Relay"]

logger = logging.getLogger(__name__)

#: Share of the lease a batch may spend publishing before it stops and releases the rest.
_LEASE_BUDGET = 0.8
#: Seconds between attempts when the database is unreachable (the poll may be far longer).
_DATABASE_RETRY_SECONDS = 1.0
#: How often (seconds) a process tends each database's events set aside behind failed ones
#: (holding.py): what arrived behind them since, and what nothing holds any more.
TEND_SECONDS = 60.0
#: How many keys a relay remembers the published ids of (the claim sends them all).
_PUBLISHED_KEYS = 1000
#: When (monotonic) this process tends each database's outbox next. Per process, not per relay:
#: the Celery task builds a relay per run, and a loop's relay should not tend again beside it.
_next_tend: dict[str, float] = {}


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
        self._sender = Sender()
        #: The routes whose events failed since this relay was made (see failures()).
        self._route_failures = RouteFailures()
        #: A published batch whose outcomes the database could not take yet.
        self._unrecorded: _Outcomes | None = None
        #: When (monotonic) the events this relay failed fall due again, soonest first: a loop
        #: that finds nothing wakes for the first instead of sleeping out its poll.
        self._retries_due: list[float] = []
        self._gone_relays = GoneRelays(self.using)
        #: This relay's seat among the relays, when it shares the keys.
        self._seating = Seating(self.using)
        #: The claim statements built for this relay's outbox (claim.py).
        self._claim_statements: Statements = {}
        #: By key, the highest id this relay published and recorded itself: the claim's per-key
        #: checks read nothing below it (claim.published_through). The keys used last.
        self._published: dict[str, int] = {}

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sender.close()
        self._seating.leave()

    def failures(self) -> list[RouteFailure]:
        """Each route whose events failed since this relay was made, with the last cause."""
        return self._route_failures.as_list()

    def _outbox(self) -> OutboxEventQuerySet:
        """The events this relay sees: the whole outbox, or those ``only`` matches."""
        events = OutboxEvent.objects.using(self.using)
        return events.all() if self.only is None else events.filter(self.only)

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
        stats.reclaimed += self._gone_relays.release(self._outbox())
        if self.share_keys:
            self._seating.look()
        events, clock = self._claim()
        if not events:
            return stats
        deadline = time.monotonic() + self.lease_seconds * _LEASE_BUDGET
        with LeaseRenewal(self._outbox(), self.lease_seconds, events[0].relay_token, clock):
            outcomes = self._publish(events, deadline)
        try:
            stats.add(self._ack(events, outcomes, clock))
        except DatabaseError:
            self._unrecorded = _Outcomes(events, outcomes, clock, time.monotonic())
            raise
        return stats

    def _claim(self) -> tuple[list[OutboxEvent], DatabaseClock]:
        return claim_batch(
            self._outbox(),
            batch_size=self.batch_size,
            lease_seconds=self.lease_seconds,
            seat=self._seating.seat,
            statements=self._claim_statements,
            published=self._published,
        )

    def _publish(self, events: list[OutboxEvent], deadline: float) -> Outcomes:
        return self._sender.send_batch(events, deadline)

    def _ack(
        self, events: list[OutboxEvent], outcomes: Outcomes, clock: DatabaseClock
    ) -> RelayStats:
        """Record the outcomes, then announce them: signals and logs see the committed state."""
        acknowledged = acknowledge(
            self._outbox(), events, outcomes, clock, self.rng, wake=self._not_alone()
        )
        # Once the acknowledgement is committed for good: a relay allowed inside a transaction
        # acknowledges in the caller's, and what rolls back was never published.
        sent = acknowledged.sent
        transaction.on_commit(lambda: self._note_published(sent), using=self.using)
        announce(acknowledged, self._sender.publisher_names, self._route_failures)
        self._forget_past_retries()
        for failure in acknowledged.failures:
            if failure.event.status == OutboxStatus.PENDING:
                delay = (failure.event.next_attempt_at - acknowledged.now).total_seconds()
                heapq.heappush(self._retries_due, time.monotonic() + max(delay, 0.0))
        return acknowledged.stats

    def _note_published(self, sent: list[OutboxEvent]) -> None:
        """Keep, per key, the highest id among ``sent``: events this relay published and whose
        acknowledgement committed, in the outermost transaction (none another relay took over
        meanwhile)."""
        published = self._published
        for event in sent:
            if event.key:
                through = max(published.pop(event.key, 0), event.pk)
                published[event.key] = through  # last: the key is used
        for key in list(itertools.islice(published, max(len(published) - _PUBLISHED_KEYS, 0))):
            del published[key]

    def _forget_past_retries(self) -> float:
        """Drop the retries that fell due (so the heap holds only those still waiting, however
        long the relay lives); the monotonic time now."""
        now = time.monotonic()
        while self._retries_due and self._retries_due[0] <= now:
            heapq.heappop(self._retries_due)
        return now

    def _sleep_at_most(self, poll: float) -> float:
        """The poll, or less: until the first of this relay's failed events falls due again."""
        now = self._forget_past_retries()
        if not self._retries_due:
            return poll
        return min(poll, self._retries_due[0] - now)

    def _not_alone(self) -> bool:
        """Whether another relay may be waiting on this one's batch: unless this relay holds a
        seat and knows itself the only one, say so (a drain, the kick, a Celery task)."""
        seat = self._seating.seat
        return seat is None or seat.fleet > 1

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

    def tend_if_due(self) -> None:
        """:meth:`tend`, if this process has not tended this database in ``TEND_SECONDS``: the
        loop and the Celery task call it before their passes."""
        if time.monotonic() >= _next_tend.get(self.using, 0.0):
            self.tend()

    def tend(self) -> None:
        """Set aside the events that arrived behind failed ones, and release the HELD events
        that nothing holds any more (holding.py)."""
        _next_tend[self.using] = time.monotonic() + TEND_SECONDS
        now = DatabaseClock.read(connections[self.using]).now()
        tended = tend(self._outbox(), now)
        if tended.set_aside or tended.released:
            logger.info(
                "outbox relay set aside %d events behind failed ones and released %d",
                tended.set_aside,
                tended.released,
                extra={"outbox_set_aside": tended.set_aside, "outbox_released": tended.released},
            )

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
        """Relay until ``stop`` is set. A pass that claimed events is followed by another at
        once; one that found nothing sleeps until a NOTIFY (PostgreSQL: a publishing commit,
        or another relay's acknowledgement), until an event it failed falls due again, or
        ``poll_seconds``."""
        stop = stop or threading.Event()
        self.share_keys = True  # running for good: one of the fleet
        poll = conf.OUTBOX_POLL_SECONDS if poll_seconds is None else poll_seconds
        busy = False  # the last pass claimed events
        with waiter(self.using) as wait:
            while not stop.is_set():
                self._between_passes(busy)
                try:
                    self.tend_if_due()
                    stats = self.run_once()
                except DatabaseError:
                    busy = False  # the next pass checks the connection, and drops it if broken
                    logger.warning("outbox relay pass failed; retrying", exc_info=True)
                    # The database, not the outbox, decides when to try again: come back soon.
                    stop.wait(min(poll, _DATABASE_RETRY_SECONDS))
                    continue
                if on_pass is not None:
                    on_pass(stats)
                if stats.claimed:
                    # Whatever freed up meanwhile (heads another relay held, events committed
                    # during the pass) is claimable now: no NOTIFY needed to come back for it.
                    busy = True
                    continue
                wait(self._sleep_at_most(poll), stop, busy)
                busy = False
        self._give_up_unrecorded()

    def _between_passes(self, busy: bool) -> None:
        """Drop the connections that broke or outlived ``CONN_MAX_AGE``, as Django does between
        requests, except that at ``CONN_MAX_AGE = 0`` (Django's default: a connection per
        request) a run of passes that each claimed events counts as one request: reconnecting
        for each batch cost the relay and the database more than the batch's own statements.
        Each pass runs its own short transactions either way, so none reads an old snapshot."""
        if busy and connections[self.using].settings_dict["CONN_MAX_AGE"] == 0:
            return
        close_old_connections()

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


@dataclass(frozen=True, slots=True)
class _Outcomes:
    """A published batch's outcomes, kept while the database cannot take them."""

    events: list[OutboxEvent]
    outcomes: Outcomes
    clock: DatabaseClock
    kept_at: float
