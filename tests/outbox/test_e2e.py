"""End to end through real processes: a Celery worker, and a relay killed mid-batch."""

import signal
import sys
import time
import uuid

import pytest
from django.db import connection, transaction
from kombu import Connection, Exchange, Queue

from django_idempotency.inbox import consume_once
from django_idempotency.models import OutboxEvent, ProcessedMessage
from django_idempotency.outbox import publish
from django_idempotency.outbox.relay import Relay
from tests.support.outbox_support import (
    database_env,
    publish_committed,
    settings_with,
    spawned,
    wait_for,
)
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def queue_name(amqp_url):
    name = f"test-e2e-{uuid.uuid4().hex}"
    yield name
    with Connection(amqp_url) as connection:
        Queue(name)(connection.default_channel).delete()


def test_celery_worker_applies_a_relayed_event_once_even_when_it_is_sent_again(
    amqp_url, queue_name
):
    worker = [
        sys.executable, "-m", "celery", "-A", "tests.support.celery_app", "worker",
        "--pool=solo", "-Q", queue_name, "--without-heartbeat", "--without-gossip",
        "--without-mingle", "--loglevel=WARNING",
        # A name of its own: its control queue must not clash with any other worker's.
        f"--hostname={queue_name}@%h",
    ]  # fmt: skip
    routes = {
        "e2e.*": {
            "BACKEND": "django_idempotency.publishers.celery.CeleryPublisher",
            "OPTIONS": {
                "app": "tests.support.celery_app.app",
                "task": "tests.testapp.tasks.record_effect",
                "queue": queue_name,
            },
        }
    }
    env = {**database_env(), "AMQP_URL": amqp_url, "TEST_CELERY_QUEUE": queue_name}
    with spawned(worker, env), settings_with(OUTBOX_PUBLISHERS=routes), Relay() as relay:
        with transaction.atomic():
            first = publish("e2e.widget", {"name": "e2e-1"})
        assert relay.drain().published == 1
        wait_for(lambda: Widget.objects.filter(name="e2e-1").exists(), what="the worker")
        # The relay sends the same event again (a lost ack, a lease taken over): same task id.
        OutboxEvent.objects.filter(pk=first.pk).update(status=OutboxEvent.Status.PENDING)
        assert relay.drain().published == 1
        # A later event behind it on the same queue proves the duplicate was consumed first.
        with transaction.atomic():
            publish("e2e.widget", {"name": "e2e-2"})
        relay.drain()
        wait_for(lambda: Widget.objects.filter(name="e2e-2").exists(), what="the worker")
    assert Widget.objects.filter(name="e2e-1").count() == 1
    markers = ProcessedMessage.objects.filter(consumer="tests.testapp.tasks.record_effect")
    assert str(first.event_id) in set(markers.values_list("message_id", flat=True))
    assert markers.count() == 2


@pytest.fixture
def crash_exchange(amqp_url):
    name = f"test-crash-{uuid.uuid4().hex}"
    exchange = Exchange(name, type="topic", durable=True)
    queue = Queue(name, exchange=exchange, routing_key="#", durable=False)
    with Connection(amqp_url) as connection:
        queue(connection.default_channel).declare()
        yield name
        channel = connection.default_channel
        queue(channel).delete()
        exchange(channel).delete()


def _crashing_relay_env(amqp_url, exchange, marker, *, lease_seconds):
    """A relay process that publishes its first batch to RabbitMQ, then hangs until killed
    (tests/support/crash_publisher.py)."""
    return {
        **database_env(),
        "DJANGO_SETTINGS_MODULE": "tests.support.settings_relay_crash",
        "AMQP_URL": amqp_url,
        "CRASH_EXCHANGE": exchange,
        "CRASH_MARKER": str(marker),
        "CRASH_LEASE_SECONDS": str(lease_seconds),
    }


def _amqp_routes(amqp_url, exchange):
    return {
        "*": {
            "BACKEND": "django_idempotency.publishers.amqp.AMQPPublisher",
            "OPTIONS": {"url": amqp_url, "exchange": exchange},
        }
    }


def test_relay_killed_between_publish_and_ack_republishes_with_the_same_event_id(
    amqp_url, crash_exchange, tmp_path
):
    with transaction.atomic():
        event = publish("orders.paid", {"order": 7})
    marker = tmp_path / "published"
    env = _crashing_relay_env(amqp_url, crash_exchange, marker, lease_seconds=2)
    relay_command = [sys.executable, "-m", "django", "outbox_relay", "--max-batches", "1"]
    with spawned(relay_command, env) as crashing:
        assert wait_for(marker.exists, what="the first publish") is True
        assert marker.read_text() == "[None]"  # RabbitMQ confirmed it
        crashing.send_signal(signal.SIGKILL)
        crashing.wait(30)
    event.refresh_from_db()
    assert event.status == OutboxEvent.Status.PENDING and event.relay_token is not None

    routes = _amqp_routes(amqp_url, crash_exchange)
    with settings_with(OUTBOX_PUBLISHERS=routes), Relay() as relay:
        # Another relay takes over once the dead relay's lease runs out.
        wait_for(lambda: relay.run_once().published, what="the lease to expire")
    event.refresh_from_db()
    assert event.status == OutboxEvent.Status.PUBLISHED

    deliveries = []
    with Connection(amqp_url) as connection:
        queue = Queue(crash_exchange)(connection.default_channel)

        def both_delivered():
            delivery = queue.get(no_ack=True)
            if delivery is not None:
                deliveries.append(delivery)
            return len(deliveries) == 2

        wait_for(both_delivered, what="both deliveries")
    assert [d.properties["message_id"] for d in deliveries] == [str(event.event_id)] * 2

    # An idempotent consumer applies it once.
    for delivery in deliveries:
        with consume_once("shipping", delivery.properties["message_id"]) as consumption:
            if consumption:
                Widget.objects.create(name=f"ship-{delivery.payload['order']}")
    assert Widget.objects.filter(name="ship-7").count() == 1


needs_session_locks = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite has no session locks"
)


@needs_session_locks
def test_a_killed_relays_batch_is_published_again_at_once_not_after_its_lease(
    amqp_url, crash_exchange, tmp_path
):
    event = publish_committed("orders.paid", {"order": 8})
    marker = tmp_path / "published"
    env = _crashing_relay_env(amqp_url, crash_exchange, marker, lease_seconds=60)
    routes = _amqp_routes(amqp_url, crash_exchange)
    relay_command = [sys.executable, "-m", "django", "outbox_relay", "--max-batches", "1"]
    with spawned(relay_command, env) as crashing:
        wait_for(marker.exists, what="the first publish")
        # Hung but alive, its session holds the batch's lock: nobody takes the batch.
        with settings_with(OUTBOX_PUBLISHERS=routes), Relay() as other:
            stats = other.run_once()
        assert (stats.claimed, stats.reclaimed) == (0, 0)
        crashing.send_signal(signal.SIGKILL)
        crashing.wait(30)
        killed_at = time.monotonic()
    with settings_with(OUTBOX_PUBLISHERS=routes), Relay() as relay:
        stats = wait_for(relay.run_once, what="the batch to be taken over")
    taken_over_after = time.monotonic() - killed_at
    print(f"\nbatch of a killed relay published again {taken_over_after:.2f} s after the kill")
    assert (stats.reclaimed, stats.published) == (1, 1), stats
    # Its lease had 60 s to run: the lock, not the lease, let the batch go.
    assert taken_over_after < 30
    event.refresh_from_db()
    assert event.status == OutboxEvent.Status.PUBLISHED


@needs_session_locks
def test_a_relay_records_what_it_published_once_the_database_answers_again(tmp_path):
    """The database drops the relay's connection between its publish and its ack: the relay
    keeps the outcome and records it a second later, instead of leaving the event leased for
    its 60 s lease and publishing it again."""
    event = publish_committed("orders.paid", {"order": 9})
    sent = tmp_path / "sent"
    env = {
        **database_env(),
        "DJANGO_SETTINGS_MODULE": "tests.support.settings_relay_file",
        "REL_PUBLISHER": "tests.support.crash_publisher.CutOffAfterPublish",
        "REL_SENT_FILE": str(sent),
        "REL_LEASE_SECONDS": "60",
    }
    relay_command = [sys.executable, "-m", "django", "outbox_relay", "--loop", "--sleep", "30"]
    published = OutboxEvent.objects.filter(pk=event.pk, status=OutboxEvent.Status.PUBLISHED)
    with spawned(relay_command, env):
        # Within half the lease: a lost outcome would keep the event leased for all of it.
        wait_for(published.exists, timeout=30, what="the outcome to be recorded")
    assert sent.with_suffix(".cut").exists(), "the connection was never dropped"
    assert sent.read_text().split() == [str(event.event_id)], "published more than once"
    event.refresh_from_db()
    assert event.relay_token is None and event.attempts == 0
