"""``operations.retry_events`` and ``discard_events`` against a real relay, including races."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from django_idempotency.models import OutboxEvent
from django_idempotency.operations import EventResult, discard_events, retry_events
from django_idempotency.operations.actions import discard, retry_dead
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.support.factories import OutboxEventFactory
from tests.support.outbox_support import HeldTransaction, settings_with, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean():
    broker.clear()
    yield
    broker.clear()


def sent_keys() -> list[str]:
    return [message.key for message in broker.snapshot()]


def relay_pass_thread(outcome: list) -> threading.Thread:
    """A thread (not started) running one relay pass on its own connection into ``outcome``."""

    def relay_pass():
        try:
            with Relay() as relay:
                outcome.append(relay.run_once())
        finally:
            connections.close_all()

    return threading.Thread(target=relay_pass)


def failing_and_due(**fields):
    """Failed twice, its backoff over: the next relay pass takes it."""
    return OutboxEventFactory(
        attempts=2, last_error="PublishError: x", next_attempt_at=timezone.now(), **fields
    )


def test_retry_and_discard_work_through_many_batches():
    OutboxEventFactory.create_batch(5, dead=True)
    OutboxEventFactory.create_batch(2, failing=True)
    OutboxEventFactory.create_batch(2, published=True)
    OutboxEventFactory.create_batch(1, leased=True)
    everything = OutboxEvent.objects.all()
    assert retry_events(everything, batch_size=3) == EventResult(7, 1, 2)
    assert OutboxEvent.objects.filter(status="PENDING", attempts=0).count() == 8
    OutboxEvent.objects.filter(status="PENDING", attempts=0, locked_until=None).update(
        status="DEAD"
    )
    assert discard_events(everything, batch_size=3) == EventResult(7, 1, 2)
    assert OutboxEvent.objects.count() == 3


def test_a_retried_event_keeps_its_place_in_its_keys_order():
    first = OutboxEventFactory(key="order-1", dead=True)
    second = OutboxEventFactory(key="order-1")
    with Relay() as relay:
        assert relay.drain().published == 0  # the DEAD event holds its key back
    retry_events(OutboxEvent.objects.filter(pk=first.pk))
    with Relay() as relay:
        assert relay.drain().published == 2
    assert [m.event_id for m in broker.snapshot()] == [first.event_id, second.event_id]


def test_retry_kicks_the_relay_once_it_commits():
    kicks = []
    OutboxEventFactory.create_batch(3, dead=True)
    with settings_with(OUTBOX_KICK=kicks.append):
        retry_events(OutboxEvent.objects.all(), batch_size=2)
        assert kicks == ["default"]
        retry_events(OutboxEvent.objects.all())  # nothing failed any more: no kick
        assert kicks == ["default"]


def test_the_short_forms_touch_dead_events_only():
    dead = OutboxEventFactory(dead=True)
    failing = OutboxEventFactory(failing=True)
    assert retry_dead() == 1
    assert OutboxEvent.objects.get(pk=failing.pk).attempts == 2
    OutboxEvent.objects.filter(pk=dead.pk).update(status="DEAD")
    assert discard(OutboxEvent.objects.all()) == 1
    assert list(OutboxEvent.objects.values_list("pk", flat=True)) == [failing.pk]


@pytest.mark.parametrize("change", [retry_events, discard_events])
def test_an_event_a_relay_is_publishing_is_left_alone_and_then_published(change):
    """The relay holds a lease (no lock) while it publishes; the operator acts meanwhile."""
    event = failing_and_due(key="order-9")
    publishing, finish = threading.Event(), threading.Event()

    def hold_publish(message):
        publishing.set()
        assert finish.wait(60)
        return False  # do not fail it

    broker.fail_when(hold_publish)
    outcome: list = []
    relay_thread = relay_pass_thread(outcome)
    relay_thread.start()
    assert publishing.wait(60), "the relay did not start publishing"
    assert change(OutboxEvent.objects.all()) == EventResult(changed=0, in_flight=1)
    finish.set()
    relay_thread.join(60)
    assert outcome[0].published == 1
    event.refresh_from_db()
    assert (event.status, event.attempts) == ("PUBLISHED", 2)
    assert sent_keys() == ["order-9"]


@pytest.mark.concurrency
def test_a_relay_never_publishes_an_event_an_operator_is_discarding():
    """The discard holds its batch's row locks until it commits. PostgreSQL's claim skips the
    locked event (SKIP LOCKED) and publishes the others at once; MariaDB's locking reads scan a
    table this small whole and queue behind the lock instead. Either way the discarded event is
    never sent, and the other one is sent once."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: its writers are serialised whole")
    doomed = failing_and_due(key="doomed")
    failing_and_due(key="other")
    outcome: list = []
    relay_thread = relay_pass_thread(outcome)
    with HeldTransaction(lambda: discard_events(OutboxEvent.objects.filter(pk=doomed.pk))) as held:
        assert held.result == EventResult(changed=1)
        relay_thread.start()
        if connection.vendor == "postgresql":
            wait_for(lambda: outcome, what="the relay pass, which must not wait for the lock")
        held.release()
    relay_thread.join(60)
    assert (outcome[0].claimed, outcome[0].published) == (1, 1)
    assert not OutboxEvent.objects.filter(pk=doomed.pk).exists()
    with Relay() as relay:
        assert relay.drain().claimed == 0
    assert sent_keys() == ["other"]


@pytest.mark.concurrency
def test_a_relay_claim_waits_for_nothing_and_a_retry_waits_for_a_relay_ack():
    """A retry that meets an ack in progress (rows locked by the relay) waits for it, then sees
    the event PUBLISHED and leaves it alone."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: its writers are serialised whole")
    event = failing_and_due()
    with HeldTransaction(
        lambda: (
            OutboxEvent.objects.select_for_update()
            .filter(pk=event.pk)
            .update(status="PUBLISHED", published_at=timezone.now(), locked_until=None)
        )
    ) as ack:
        results = []
        retrying = threading.Thread(
            target=lambda: (results.append(retry_events(OutboxEvent.objects.all())),
                            connections.close_all())
        )  # fmt: skip
        retrying.start()
        retrying.join(1)
        assert retrying.is_alive(), "the retry did not wait for the ack's row lock"
        ack.release()
        retrying.join(60)
    wait_for(lambda: results, what="the retry")
    assert results == [EventResult(changed=0, in_flight=0, not_failed=1)]
    event.refresh_from_db()
    assert event.status == "PUBLISHED" and event.attempts == 2


def test_an_expired_lease_counts_as_free():
    """A relay that died mid-batch leaves a lease that runs out; its events can be retried."""
    event = failing_and_due(locked_until=timezone.now() - timedelta(seconds=1))
    assert retry_events(OutboxEvent.objects.all()) == EventResult(changed=1)
    event.refresh_from_db()
    assert (event.attempts, event.locked_until, event.relay_token) == (0, None, None)
