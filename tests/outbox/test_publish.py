import uuid

import pytest
from django.db import connection, transaction

from django_idempotency import signals
from django_idempotency.exceptions import DuplicateEventId, TransactionRequired, UnroutableTopic
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.publish import NOTIFY_CHANNEL, kick_after_commit, publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import (
    is_postgresql,
    publish_committed,
    published_ids,
    settings_with,
)

pytestmark = pytest.mark.django_db(transaction=True)

kicks: list[str] = []


def record_kick(using: str) -> None:
    kicks.append(using)


def failing_kick(using: str) -> None:
    raise RuntimeError("broker down")


@pytest.fixture(autouse=True)
def clean():
    broker.clear()
    kicks.clear()
    yield
    broker.clear()


def test_publish_outside_a_transaction_is_refused():
    with pytest.raises(TransactionRequired, match="transaction.atomic"):
        publish("orders.paid", {"id": 1})
    assert not OutboxEvent.objects.exists()


def test_opt_out_commits_the_event_on_its_own():
    event = publish("orders.paid", {"id": 1}, require_atomic=False)
    assert OutboxEvent.objects.get().event_id == event.event_id
    with settings_with(OUTBOX_REQUIRE_ATOMIC=False):
        publish("orders.paid", {"id": 2})
    assert OutboxEvent.objects.count() == 2


def test_rolled_back_events_are_never_published_and_committed_ones_are():
    committed = publish_committed(payload={"keep": True})
    with pytest.raises(RuntimeError), transaction.atomic():
        publish("orders.paid", {"keep": False})
        raise RuntimeError("business failure")
    with (
        transaction.atomic(),
        pytest.raises(RuntimeError),
        transaction.atomic(),  # a savepoint, rolled back
    ):
        publish("orders.paid", {"keep": False})
        raise RuntimeError("nested failure")
    assert OutboxEvent.objects.count() == 1
    with Relay() as relay:
        stats = relay.drain()
    assert stats.published == 1
    assert published_ids() == [str(committed.event_id)]
    assert broker.messages[0].payload == {"keep": True}
    event = OutboxEvent.objects.get()
    assert event.status == OutboxEvent.Status.PUBLISHED
    assert event.published_at is not None
    assert event.locked_until is None and event.relay_token is None


def test_kick_runs_once_per_transaction_after_commit():
    with settings_with(OUTBOX_KICK="tests.outbox.test_publish.record_kick"):
        with transaction.atomic():
            for n in range(3):
                publish("orders.paid", {"n": n})
            assert kicks == []  # not before the commit
        assert kicks == ["default"]
        with pytest.raises(RuntimeError), transaction.atomic():
            publish("orders.paid", {"n": 4})
            raise RuntimeError
        assert kicks == ["default"]


def test_a_rolled_back_savepoint_does_not_lose_the_kick():
    with settings_with(OUTBOX_KICK="tests.outbox.test_publish.record_kick"):
        with transaction.atomic():
            with pytest.raises(RuntimeError), transaction.atomic():
                publish("orders.paid", {"n": 1})
                raise RuntimeError
            publish("orders.paid", {"n": 2})
        assert kicks == ["default"]


def test_a_failing_kick_does_not_fail_the_commit():
    with settings_with(OUTBOX_KICK="tests.outbox.test_publish.failing_kick"):
        publish_committed()
    assert OutboxEvent.objects.count() == 1


def test_relay_now_kick_publishes_on_commit():
    with settings_with(OUTBOX_KICK="django_idempotency.testing.relay_now"):
        event = publish_committed()
    assert published_ids() == [str(event.event_id)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topic": ""}, "topic must be a non-empty string"),
        ({"topic": "x" * 256}, "topic must be"),
        ({"key": "k" * 256}, "key must be"),
        ({"payload": {"when": object()}}, "payload must be JSON-serialisable"),
        ({"headers": {1: "x"}}, "headers must be a mapping with string keys"),
        ({"headers": ["x"]}, "headers must be a mapping"),
        ({"event_id": "not-a-uuid"}, "event_id must be a UUID"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(kwargs, message):
    args = {"topic": "orders.paid", "payload": {"n": 1}, **kwargs}
    with pytest.raises(ValueError, match=message), transaction.atomic():
        publish(args.pop("topic"), args.pop("payload"), **args)
    assert not OutboxEvent.objects.exists()


def test_an_unroutable_topic_fails_at_publish_time():
    with (
        settings_with(
            OUTBOX_PUBLISHERS={"orders.*": "django_idempotency.publishers.log.LoggingPublisher"}
        ),
        pytest.raises(UnroutableTopic, match="OUTBOX_PUBLISHERS"),
        transaction.atomic(),
    ):
        publish("invoices.sent", {})


def test_a_duplicate_event_id_is_a_clear_error():
    event_id = uuid.uuid4()
    publish_committed(event_id=event_id)
    with pytest.raises(DuplicateEventId, match=str(event_id)), transaction.atomic():
        publish("orders.paid", {}, event_id=str(event_id))
    assert OutboxEvent.objects.count() == 1


def test_event_fields_and_enqueued_signal():
    seen = []

    def receiver(sender, event, **kwargs):
        seen.append(event)

    signals.event_enqueued.connect(receiver)
    try:
        event = publish_committed(
            "orders.paid", {"total": "9.99"}, key=42, headers={"tenant": "acme"}
        )
    finally:
        signals.event_enqueued.disconnect(receiver)
    assert seen == [event]
    stored = OutboxEvent.objects.get()
    assert (stored.topic, stored.key, stored.payload, stored.headers) == (
        "orders.paid",
        "42",
        {"total": "9.99"},
        {"tenant": "acme"},
    )
    assert stored.status == OutboxEvent.Status.PENDING
    assert stored.attempts == 0
    assert stored.next_attempt_at == stored.created_at


def test_transaction_id_is_deprecated_and_always_zero():
    with transaction.atomic():
        first = publish("orders.paid", {}, key="k")
        publish("orders.paid", {})
    assert set(OutboxEvent.objects.values_list("transaction_id", flat=True)) == {0}
    assert first.transaction_id == 0


def test_commit_notifies_listeners_on_postgresql():
    if not is_postgresql():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    listener = connection.get_new_connection(connection.get_connection_params())
    listener.autocommit = True
    try:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        with transaction.atomic():
            publish("orders.paid", {})
            publish("orders.paid", {})
            assert list(listener.notifies(timeout=0.2, stop_after=1)) == []
        received = list(listener.notifies(timeout=30, stop_after=1))
        assert [note.channel for note in received] == [NOTIFY_CHANNEL]
    finally:
        listener.close()


def test_a_transaction_kicked_by_an_operator_action_still_notifies():
    if not is_postgresql():
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    listener = connection.get_new_connection(connection.get_connection_params())
    listener.autocommit = True
    try:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        with transaction.atomic():
            kick_after_commit("default")  # as retry_events() does, before any publish
            publish("orders.paid", {})
        received = list(listener.notifies(timeout=30, stop_after=1))
        assert [note.channel for note in received] == [NOTIFY_CHANNEL]
    finally:
        listener.close()
