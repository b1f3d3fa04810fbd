import random
import re
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.models import F, Q
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.exceptions import BrokerUnavailable, OutboxError
from django_idempotency.models import OutboxEvent
from django_idempotency.operations.actions import discard, retry_dead
from django_idempotency.outbox import publish
from django_idempotency.outbox.ack import backoff_delay
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.send import send
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import (
    CeilingRandom,
    HeldTransaction,
    database_now,
    is_postgresql,
    publish_committed,
    settings_with,
    wait_for,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean():
    broker.clear()
    yield
    broker.clear()


def sent_payloads():
    return [message.payload["n"] for message in broker.snapshot()]


def test_relay_refuses_to_run_inside_a_transaction():
    publish_committed()
    with pytest.raises(OutboxError, match="must not run inside"), transaction.atomic():
        Relay().run_once()
    assert broker.snapshot() == []


def test_batches_go_out_in_id_order_and_carry_the_event_id():
    events = [publish_committed(payload={"n": n}) for n in range(5)]
    with Relay(batch_size=2) as relay:
        stats = relay.drain()
    assert stats.published == 5 and stats.claimed == 5
    assert sent_payloads() == [0, 1, 2, 3, 4]
    assert [m.event_id for m in broker.snapshot()] == [e.event_id for e in events]
    assert {m.attempt for m in broker.snapshot()} == {1}


def test_a_failing_event_holds_back_its_key_only():
    for n in range(3):
        publish_committed(payload={"n": n}, key="order-1")
        publish_committed(payload={"n": 10 + n}, key="order-2")
    publish_committed(payload={"n": 99})  # no key: never held back
    broker.fail_when(lambda m: m.payload["n"] == 0)
    with Relay(rng=CeilingRandom()) as relay:  # a full second's backoff: drained once, not twice
        stats = relay.drain()
    assert sent_payloads() == [10, 99, 11, 12]
    assert stats.failed == 1 and stats.published == 4
    assert OutboxEvent.objects.filter(key="order-1").pending().count() == 3
    # Once the broker takes it, the held key drains in order.
    broker.fail_when(None)
    OutboxEvent.objects.update(next_attempt_at=timezone.now())
    with Relay() as relay:
        relay.drain()
    assert sent_payloads() == [10, 99, 11, 12, 0, 1, 2]


def test_a_relay_made_with_only_sees_nothing_else_of_the_outbox():
    """``Relay(only=...)``: it claims only the matching events, and an event it does not see
    (an earlier one of the same key, leased elsewhere) holds none of them back."""
    gate = publish_committed(payload={"n": 0}, key="k")
    OutboxEvent.objects.filter(pk=gate.pk).update(
        locked_until=timezone.now() + timedelta(days=1)
    )  # leased by another relay: every other relay holds the key back
    mine = [publish_committed(payload={"n": n}, key="k") for n in (1, 2)]
    with Relay() as relay:
        assert relay.drain().claimed == 0
    other = publish_committed(payload={"n": 3})
    with Relay(only=Q(pk__in=[event.pk for event in mine])) as relay:
        stats = relay.drain()
    assert (stats.claimed, stats.published) == (2, 2)
    assert sent_payloads() == [1, 2]
    assert OutboxEvent.objects.get(pk=other.pk).status == OutboxEvent.Status.PENDING


def test_per_key_order_holds_across_many_injected_failures():
    keys = ["a", "b", "c"]
    for n in range(30):
        publish_committed(payload={"n": n, "key": keys[n % 3]}, key=keys[n % 3])
    chance = random.Random(7)
    broker.fail_when(lambda m: chance.random() < 0.4)
    fast_backoff = settings_with(
        OUTBOX_BACKOFF_BASE_SECONDS=0.001, OUTBOX_BACKOFF_MAX_SECONDS=0.002
    )
    with fast_backoff, Relay(batch_size=7) as relay:
        for _ in range(500):
            relay.drain()
            if not OutboxEvent.objects.pending().exists():
                break
    assert not OutboxEvent.objects.unpublished().exists()
    for key in keys:
        sequence = [m.payload["n"] for m in broker.snapshot() if m.key == key]
        assert sequence == sorted(sequence) and len(sequence) == 10


def test_backoff_is_exponential_with_full_jitter_and_capped():
    with settings_with(OUTBOX_BACKOFF_BASE_SECONDS=2, OUTBOX_BACKOFF_MAX_SECONDS=30):
        ceilings = [backoff_delay(attempts, CeilingRandom()) for attempts in range(1, 8)]
        assert ceilings == [2, 4, 8, 16, 30, 30, 30]
        samples = [backoff_delay(3, random.Random(seed)) for seed in range(200)]
    assert all(0 <= sample <= 8 for sample in samples)
    assert min(samples) < 2 and max(samples) > 6  # spread over the whole range


def test_failures_schedule_the_next_attempt_by_backoff():
    event = publish_committed()
    broker.fail_when(lambda m: True)
    with settings_with(OUTBOX_BACKOFF_BASE_SECONDS=5, OUTBOX_BACKOFF_MAX_SECONDS=60):
        for attempt in range(1, 5):
            before = database_now()
            with Relay(rng=CeilingRandom()) as relay:
                assert relay.run_once().failed == 1
            after = database_now()
            event.refresh_from_db()
            delay = timedelta(seconds=min(60, 5 * 2 ** (attempt - 1)))
            # Scheduled by the database's clock, from the moment of the failure.
            assert before + delay <= event.next_attempt_at <= after + delay
            assert event.attempts == attempt
            assert "injected failure" in event.last_error
            with Relay() as relay:  # not due yet: nothing happens
                assert relay.run_once().claimed == 0
            # The backoff runs out.
            OutboxEvent.objects.update(next_attempt_at=F("next_attempt_at") - delay)


def test_an_event_is_dead_after_max_attempts_and_retry_dead_brings_it_back():
    event = publish_committed(key="k")
    later = publish_committed(key="k", payload={"n": 2})
    dead, failed = [], []
    on_dead = lambda sender, **kw: dead.append(kw)  # noqa: E731
    on_failed = lambda sender, **kw: failed.append(kw)  # noqa: E731
    signals.event_dead.connect(on_dead)
    signals.publish_failed.connect(on_failed)
    broker.fail_when(lambda m: m.event_id == event.event_id)
    try:
        three_attempts = settings_with(OUTBOX_MAX_ATTEMPTS=3, OUTBOX_BACKOFF_BASE_SECONDS=0.001)
        with three_attempts, Relay(rng=random.Random(1)) as relay:
            for _ in range(3):
                OutboxEvent.objects.pending().update(next_attempt_at=timezone.now())
                relay.run_once()
    finally:
        # Only these: clearing every receiver would also drop the metrics module's.
        signals.event_dead.disconnect(on_dead)
        signals.publish_failed.disconnect(on_failed)
    event.refresh_from_db()
    assert event.status == OutboxEvent.Status.DEAD and event.attempts == 3
    assert [kw["attempts"] for kw in failed] == [1, 2, 3]
    assert failed[-1]["next_attempt_at"] is None
    assert len(dead) == 1 and dead[0]["event"].event_id == event.event_id
    # A DEAD event keeps its key's order: the later event waits for a person.
    with Relay() as relay:
        assert relay.drain().claimed == 0
    assert broker.snapshot() == []
    broker.fail_when(None)
    assert retry_dead(OutboxEvent.objects.filter(pk=event.pk)) == 1
    event.refresh_from_db()
    assert (event.status, event.attempts) == (OutboxEvent.Status.PENDING, 0)
    with Relay() as relay:
        relay.drain()
    assert [m.event_id for m in broker.snapshot()] == [event.event_id, later.event_id]


def test_a_broker_outage_never_makes_an_event_dead():
    event = publish_committed()
    broker.fail_when(lambda m: True, BrokerUnavailable)
    two_attempts = settings_with(OUTBOX_MAX_ATTEMPTS=2, OUTBOX_BACKOFF_BASE_SECONDS=0.001)
    with two_attempts, Relay(rng=random.Random(1)) as relay:
        for _ in range(5):
            OutboxEvent.objects.pending().update(next_attempt_at=timezone.now())
            relay.run_once()
        event.refresh_from_db()
        assert (event.status, event.attempts) == (OutboxEvent.Status.PENDING, 5)
        assert "BrokerUnavailable" in event.last_error
        broker.fail_when(None)
        OutboxEvent.objects.pending().update(next_attempt_at=timezone.now())
        assert relay.drain().published == 1
    assert [m.event_id for m in broker.snapshot()] == [event.event_id]


def test_discard_deletes_only_dead_events_and_frees_the_key():
    first = publish_committed(key="k")
    second = publish_committed(key="k")
    OutboxEvent.objects.filter(pk=first.pk).update(status=OutboxEvent.Status.DEAD)
    assert discard(OutboxEvent.objects.all()) == 1
    assert list(OutboxEvent.objects.values_list("pk", flat=True)) == [second.pk]
    with Relay() as relay:
        relay.drain()
    assert [m.event_id for m in broker.snapshot()] == [second.event_id]


def test_a_relay_whose_lease_ran_out_cannot_mark_events_another_relay_owns():
    event = publish_committed()
    slow = Relay(lease_seconds=60)
    claimed, clock = slow._claim()
    assert [e.pk for e in claimed] == [event.pk]
    # The lease runs out (by the database's clock) while the first relay still publishes.
    OutboxEvent.objects.update(locked_until=F("locked_until") - timedelta(seconds=61))
    with Relay() as other:
        assert other.run_once().published == 1
    # The first relay now finishes its publish and tries to acknowledge: fenced out.
    outcomes = slow._publish(claimed, deadline=float("inf"))
    stats = slow._ack(claimed, outcomes, clock)
    slow.close()
    assert stats.lost == 1 and stats.published == 0
    assert [m.event_id for m in broker.snapshot()] == [event.event_id] * 2
    event.refresh_from_db()
    assert event.status == OutboxEvent.Status.PUBLISHED and event.relay_token is None


def test_an_acknowledgement_refused_once_counts_each_failure_once_when_it_is_retried():
    """The relay keeps the outcomes of a batch whose acknowledgement the database refused and
    records them at its next pass, from the same events: a failure is still one attempt."""
    event = publish_committed()
    broker.fail_when(lambda message: True)
    refused: list[str] = []

    def refuse_the_first_ack(execute, sql, params, many, context):
        # The acknowledgement writes the error: one statement on PostgreSQL, the failure's own
        # UPDATE elsewhere (after the locking SELECT).
        if not refused and re.search(r'[`"]last_error[`"] =', sql):
            refused.append(sql)
            raise OperationalError("the database went away")
        return execute(sql, params, many, context)

    with Relay(rng=CeilingRandom()) as relay:
        with connection.execute_wrapper(refuse_the_first_ack), pytest.raises(OperationalError):
            relay.run_once()
        stats = relay.run_once()
    assert refused, "the acknowledgement was never refused"
    assert (stats.recorded_late, stats.failed, stats.lost) == (1, 1, 0)
    event.refresh_from_db()
    assert (event.status, event.attempts, event.relay_token) == ("PENDING", 1, None)


def test_events_not_sent_before_the_lease_budget_ran_out_are_released():
    for n in range(3):
        publish_committed(payload={"n": n})
    with Relay(lease_seconds=1e-9) as relay:
        stats = relay.run_once()
    assert (stats.claimed, stats.released, stats.published) == (3, 3, 0)
    assert not OutboxEvent.objects.filter(locked_until__isnull=False).exists()
    with Relay() as relay:
        assert relay.drain().published == 3


def test_a_topic_without_publisher_at_relay_time_fails_with_the_reason():
    publish_committed("orders.paid")
    with settings_with(OUTBOX_PUBLISHERS={"invoices.*": "x.Y"}), Relay() as relay:
        assert relay.run_once().failed == 1
    assert "No publisher for topic 'orders.paid'" in OutboxEvent.objects.get().last_error


def test_published_signals_carry_the_events_and_publisher():
    seen, batches = [], []
    receiver = lambda sender, **kw: seen.append(kw)  # noqa: E731
    batch_receiver = lambda sender, **kw: batches.append(kw)  # noqa: E731
    signals.event_published.connect(receiver)
    signals.events_published.connect(batch_receiver)
    try:
        events = [publish_committed(payload={"n": n}, key="k") for n in range(3)]
        with Relay() as relay:
            relay.drain()
    finally:
        signals.event_published.disconnect(receiver)
        signals.events_published.disconnect(batch_receiver)
    sent = [event.event_id for event in events]
    assert [(kw["event"].event_id, kw["publisher"]) for kw in seen] == [
        (event_id, "MemoryPublisher") for event_id in sent
    ]
    assert [([e.event_id for e in kw["events"]], kw["publisher"]) for kw in batches] == [
        (sent, "MemoryPublisher")
    ]
    assert all(e.status == OutboxStatus.PUBLISHED for kw in batches for e in kw["events"])


def test_a_long_open_transaction_holds_back_no_keyed_event():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite's relay waits for any open writer: one write lock")
    # A transaction that began first and is still open (it wrote, and published another key)
    # no longer delays keyed events of other keys: only a transaction holding the key can.
    with HeldTransaction(lambda: publish("orders.paid", {"n": 1}, key="other")):
        keyed = publish_committed(payload={"n": 2}, key="k")
        keyless = publish_committed(payload={"n": 3})
        with Relay() as relay:
            relay.drain()
        assert [m.event_id for m in broker.snapshot()] == [keyed.event_id, keyless.event_id]
    with Relay() as relay:
        relay.drain()
    assert [m.payload["n"] for m in broker.snapshot()] == [2, 3, 1]


def test_an_idle_relay_loop_wakes_on_a_publishing_commit():
    if not is_postgresql():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    with _idle_relay_loop():
        _a_commit_wakes_it()


@contextmanager
def _idle_relay_loop():
    """A relay loop in a thread, polling only every 300 s, idle after its first pass; stopped
    when the block ends."""
    stop, idle = threading.Event(), threading.Event()

    def loop():
        try:
            with Relay() as relay:
                relay.run_forever(stop, poll_seconds=300, on_pass=lambda stats: idle.set())
        finally:
            connections.close_all()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        assert idle.wait(30)
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def _a_commit_wakes_it():
    event = publish_committed()
    # The loop polls every 300 s: only a NOTIFY wakes it in time.
    wait_for(broker.snapshot, what="the NOTIFY to wake the relay")
    assert [m.event_id for m in broker.snapshot()] == [event.event_id]


def test_a_relay_listens_again_after_losing_its_listen_connection(caplog):
    if not is_postgresql():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    with _idle_relay_loop():
        # The database drops the listening session, as a restart would.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                "current_database() AND query = %s AND pid <> pg_backend_pid()",
                ["LISTEN django_idempotency_outbox"],
            )
            assert cursor.fetchone() == (True,)
        wait_for(lambda: "listening for commits again" in caplog.text, what="LISTEN again")
        time.sleep(0.5)  # the pass that follows, for commits nobody heard
        _a_commit_wakes_it()
    assert "lost its LISTEN connection" in caplog.text


def test_a_batch_still_being_published_keeps_its_lease_past_its_length():
    """A one-second lease, a batch that takes seconds: the renewals keep it the relay's."""
    event = publish_committed()
    release = threading.Event()
    result = {}

    def slow_relay():
        try:
            with Relay(lease_seconds=1.0) as relay:
                publish = relay._publish

                def publish_then_wait(events, deadline):
                    outcomes = publish(events, deadline)
                    release.wait(30)
                    return outcomes

                relay._publish = publish_then_wait
                result["stats"] = relay.run_once()
        finally:
            connections.close_all()

    thread = threading.Thread(target=slow_relay, daemon=True)
    thread.start()
    try:
        wait_for(broker.snapshot, what="the publish")
        first_lease = OutboxEvent.objects.get().locked_until
        time.sleep(2.5)  # two and a half leases
        event.refresh_from_db()
        assert event.locked_until > first_lease, "the lease was never renewed"
        with Relay() as other:
            stats = other.run_once()
        assert (stats.claimed, stats.reclaimed) == (0, 0)
    finally:
        release.set()
        thread.join(30)
    assert (result["stats"].published, result["stats"].lost) == (1, 0)
    assert [m.event_id for m in broker.snapshot()] == [event.event_id]


@pytest.mark.parametrize("take_over", [True, False])
def test_a_batch_whose_relay_session_is_gone_is_released_unless_turned_off(take_over):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no session locks: the lease is all there is")
    event = publish_committed()
    with settings_with(TAKE_OVER_DEAD_OWNERS=take_over):
        gone = Relay(lease_seconds=60)
        claimed, _ = gone._claim()
        assert [e.pk for e in claimed] == [event.pk]
        connection.close()  # its session ends, and the batch's lock with it
        with Relay() as other:
            stats = other.run_once()
    if take_over:
        assert (stats.reclaimed, stats.published) == (1, 1)
        assert [m.event_id for m in broker.snapshot()] == [event.event_id]
    else:  # behind a pooler that breaks session locks: wait for the lease
        assert (stats.reclaimed, stats.claimed) == (0, 0)
        event.refresh_from_db()
        assert event.relay_token == claimed[0].relay_token


class ExplodingPublisher:
    """Stands in for a publisher whose batch call itself breaks."""

    def __init__(self, results=None):
        self.results = results

    def publish_many(self, messages):
        if self.results is None:
            raise RuntimeError("publisher bug")
        return self.results


@pytest.mark.parametrize(
    ("publisher", "error"),
    [(ExplodingPublisher(), "publisher bug"), (ExplodingPublisher([None]), "wrong count")],
)
def test_a_publisher_that_breaks_fails_its_whole_group(publisher, error):
    events = [publish_committed(payload={"n": n}) for n in range(2)]
    results = send(publisher, [OutboxEvent.objects.get(pk=e.pk) for e in events])
    assert len(results) == 2 and all(error in str(result) for result in results)


@pytest.mark.concurrency
def test_a_claim_that_waited_for_the_database_lock_still_gets_its_whole_lease():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's claim queues for the write lock; SKIP LOCKED claims do not wait")
    publish_committed()
    lease = 60
    claimed = {}
    asked = threading.Event()

    def claim():
        try:
            asked.set()
            claimed["rows"] = Relay(lease_seconds=lease)._claim()[0]
        finally:
            connections.close_all()

    # Another writer holds SQLite's write lock (BEGIN IMMEDIATE): the claim can only take its
    # lease after that writer lets go.
    with HeldTransaction(lambda: OutboxEvent.objects.count()) as writer:
        thread = threading.Thread(target=claim)
        thread.start()
        assert asked.wait(30)
        time.sleep(1)  # let the claim queue for the lock (the assertion holds either way)
        released_at = timezone.now()
        writer.release()
        thread.join(60)
    (row,) = claimed["rows"]
    # The lease runs from when the claim got the lock, so the publish budget (a share of the
    # lease, counted from after the claim) can never outlast it.
    assert row.locked_until >= released_at + timedelta(seconds=lease)


def test_a_polling_relay_comes_back_soon_after_a_busy_pass_and_backs_off_while_idle():
    """Without LISTEN the relay polls: 50 ms after a pass that found events, then twice as long
    after each pass that finds none, never longer than the poll."""
    from django_idempotency.outbox.waiting import waiter

    class Recorded(threading.Event):
        def __init__(self):
            super().__init__()
            self.waits = []

        def wait(self, timeout=None):
            self.waits.append(timeout)
            return False

    stop = Recorded()
    with settings_with(OUTBOX_NOTIFY=False), waiter(connection.alias) as wait:
        wait(1.0, stop, True)
        for _ in range(6):
            wait(1.0, stop, False)
        wait(1.0, stop, True)
    assert stop.waits == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 0.05]


def test_a_relay_builds_its_claim_statement_once_and_each_claim_gets_its_own_token_and_lock(
    monkeypatch,
):
    """PostgreSQL: the ORM builds the claim statement once per relay and seat; each claim puts
    its own token and relay lock in it (each batch's lock let go by its acknowledgement)."""
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim is PostgreSQL's")
    from django_idempotency.db import postgresql, session_locks
    from django_idempotency.outbox import claim as claim_module

    built: list[str] = []
    build = claim_module.postgresql.outbox_claim_statement

    def counting(*args, **kwargs):
        built.append("statement")
        return build(*args, **kwargs)

    monkeypatch.setattr(claim_module.postgresql, "outbox_claim_statement", counting)
    locks: list[int] = []

    def claimed_lock(relay: Relay) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s::oid "
                "AND pid = pg_backend_pid()",  # the relay's session: not other tests' relays
                [postgresql.RELAY_LOCK_CLASS],
            )
            locks.extend(row[0] for row in cursor.fetchall())

    for n in range(4):
        publish_committed(payload={"n": n}, key=f"k{n % 2}")
    tokens = []
    with Relay(batch_size=1) as relay:
        claim = relay._claim

        def noting_claim() -> Any:
            events, clock = claim()
            tokens.extend(event.relay_token for event in events)
            claimed_lock(relay)
            return events, clock

        monkeypatch.setattr(relay, "_claim", noting_claim)
        assert relay.drain().published == 4
    assert built == ["statement"]
    assert len(set(tokens)) == 4
    if session_locks.enabled("default"):
        assert locks == [session_locks.lock_id(token) & 0xFFFFFFFF for token in tokens]
    claimed_lock(relay)
    assert locks[4:] == []  # every batch's lock let go
    assert [m.payload["n"] for m in broker.snapshot()] == [0, 1, 2, 3]


def test_relays_in_different_seats_claim_with_statements_of_their_own():
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim is PostgreSQL's")
    from django_idempotency.db.session_locks import Seat
    from django_idempotency.outbox.claim import claim_batch

    events = [publish_committed(payload={"n": n}, key=f"k{n}") for n in range(20)]
    statements: dict[Any, Any] = {}
    shares = [
        claim_batch(
            OutboxEvent.objects.all(),
            batch_size=100,
            lease_seconds=30,
            seat=Seat(number=rank, rank=rank, fleet=2),
            statements=statements,
        )[0]
        for rank in (0, 1)
    ]
    assert len(statements) == 2
    first, second = ({event.pk for event in share} for share in shares)
    assert first and second and not first & second
    assert first | second == {event.pk for event in events}
