"""The fixtures the package ships for its users' test suites (registered through pytest11)."""

import random

import pytest
from django.db import transaction

from django_idempotency.outbox import publish
from tests.testapp import tasks
from tests.testapp.models import Widget


@pytest.mark.django_db(transaction=True)
def test_outbox_relay_publishes_on_commit(outbox_relay):
    with transaction.atomic():
        event = publish("orders.paid", {"id": 1}, key="order-1")
        assert outbox_relay.messages == []
    assert [m.event_id for m in outbox_relay.messages] == [event.event_id]
    assert outbox_relay.topics() == ["orders.paid"]


@pytest.mark.django_db
def test_outbox_relay_inside_a_test_transaction(outbox_relay, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        publish("orders.paid", {"id": 1}, key="order-1")
        publish("orders.paid", {"id": 2}, key="order-1")
    assert [m.payload["id"] for m in outbox_relay.messages] == [1, 2]


@pytest.mark.django_db
def test_outbox_relay_can_fail_and_be_run_by_hand(outbox_relay):
    outbox_relay.fail_when(lambda message: True)
    with transaction.atomic():
        publish("orders.paid", {"id": 1})
    assert outbox_relay.relay().failed == 1
    assert outbox_relay.messages == []


@pytest.mark.django_db
def test_a_failing_event_is_tried_once_per_relay_whatever_the_jitter_draws(
    outbox_relay, monkeypatch
):
    """The relay's backoff is a random part of its ceiling; the fixture's relay waits the whole
    of it, so one relay() tries a failing event once even when a draw would have made it due
    again at once."""
    monkeypatch.setattr(random.Random, "uniform", lambda self, a, b: a)  # the shortest backoff
    outbox_relay.fail_when(lambda message: True)
    with transaction.atomic():
        publish("orders.paid", {"id": 1})
    stats = outbox_relay.relay()
    assert (stats.claimed, stats.failed) == (1, 1)


@pytest.mark.django_db
def test_assert_publishes_checks_count_topic_and_key(assert_publishes):
    with assert_publishes(2, topic="orders.paid") as events, transaction.atomic():
        publish("orders.paid", {"id": 1}, key="a")
        publish("orders.paid", {"id": 2}, key="b")
        publish("orders.refunded", {"id": 3})
    assert [event.key for event in events] == ["a", "b"]
    with assert_publishes(key="b"), transaction.atomic():
        publish("orders.paid", {}, key="b")
    with (
        pytest.raises(AssertionError, match="expected 1 events"),
        assert_publishes(1),
        transaction.atomic(),
    ):
        pass
    with (
        pytest.raises(AssertionError, match="published none"),
        assert_publishes(topic="x"),
        transaction.atomic(),
    ):
        publish("orders.paid", {})


@pytest.mark.django_db
def test_deliver_twice_and_plain_callables(deliver_twice):
    first, second = deliver_twice(tasks.record_effect, "plugin")
    assert first is not None and second is None
    assert Widget.objects.filter(name="plugin").count() == 1
    calls = []
    assert deliver_twice(lambda x: calls.append(x) or x, 5) == (5, 5)
    assert calls == [5, 5]


@pytest.mark.django_db(transaction=True)
def test_deliver_concurrently_reports_each_result(deliver_concurrently):
    results = deliver_concurrently(tasks.fail_after_writing, "boom", times=2)
    assert all(isinstance(result, tasks.HandlerFailed) for result in results)
    assert not Widget.objects.exists()
