"""Outages explained where they happen: the on-commit kick logs one line (the events are kept,
the relay will send them, the cause) without a traceback unless DEBUG, and ``outbox_relay``
exits with a message naming each failing route and its cause."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import OperationalError, transaction
from kombu.exceptions import OperationalError as KombuOperationalError

from django_idempotency import tasks
from django_idempotency.exceptions import BrokerUnavailable
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import publish_committed, relays_back_off_in_full, settings_with

pytestmark = pytest.mark.django_db(transaction=True)

MEMORY = "django_idempotency.publishers.memory.MemoryPublisher"
REFUSED = "[Errno 111] Connection refused"
KICK_FAILURE = "outbox relay kick failed"


@pytest.fixture(autouse=True)
def clean_broker() -> Iterator[None]:
    broker.clear()
    yield
    broker.clear()


@pytest.fixture(autouse=True)
def full_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """With jitter, a backoff drawn near zero fell due again inside the test, and a failure
    was counted twice."""
    relays_back_off_in_full(monkeypatch)


def kick_records(caplog: Any) -> list[logging.LogRecord]:
    return [record for record in caplog.records if KICK_FAILURE in record.getMessage()]


def wait_until_idle(kicker: tasks._RelayKicker, calls: list[Any], count: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while not (kicker.idle.is_set() and len(calls) >= count):
        assert time.monotonic() < deadline, "the kick thread did not settle"
        time.sleep(0.01)


def broker_down(calls: list[Any]) -> Any:
    def apply_async(**options: Any) -> None:
        calls.append(options)
        raise KombuOperationalError(REFUSED)

    return apply_async


# --- the kick after commit ----------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_a_broker_outage_at_the_kick_is_one_line_saying_the_events_are_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: Any, settings: Any, debug: bool
) -> None:
    settings.DEBUG = debug
    calls: list[Any] = []
    monkeypatch.setattr(tasks.relay_outbox, "apply_async", broker_down(calls))
    with caplog.at_level(logging.WARNING, logger="django_idempotency"):
        tasks.kick_relay("default")
        wait_until_idle(tasks._kicker, calls, 1)
    (record,) = kick_records(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "\n" not in message
    assert f"OperationalError: {REFUSED}" in message  # the cause
    assert "kept in the outbox" in message  # nothing is lost
    assert "next relay pass sends them" in message  # and what will happen
    assert (record.exc_info is not None) is debug  # the traceback only with DEBUG


def test_a_kick_that_raises_after_commit_is_one_line_too(caplog: Any) -> None:
    with (
        settings_with(OUTBOX_KICK="tests.outbox.test_publish.failing_kick"),
        caplog.at_level(logging.WARNING, logger="django_idempotency"),
        transaction.atomic(),
    ):
        publish("orders.paid", {"n": 1})
    (record,) = kick_records(caplog)
    assert record.exc_info is None
    assert "kept in the outbox" in record.getMessage()


# --- the relay command ---------------------------------------------------------------------------


def relay_command(*args: str) -> str:
    out = StringIO()
    call_command("outbox_relay", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_the_relay_command_names_the_failing_route_and_its_cause() -> None:
    routes = {"orders.*": MEMORY, "*": MEMORY}
    with settings_with(OUTBOX_PUBLISHERS=routes, OUTBOX_BACKOFF_BASE_SECONDS=60):
        publish_committed("orders.paid")
        publish_committed("orders.refunded")
        publish_committed("mail.sent")
        broker.fail_when(lambda message: message.topic.startswith("orders."), BrokerUnavailable)
        with pytest.raises(CommandError) as raised:
            relay_command()
    message = str(raised.value)
    assert raised.value.returncode == 3
    assert "2 events failed to publish; they stay in the outbox" in message
    assert "route 'orders.*' (MemoryPublisher): 2 events, BrokerUnavailable: injected" in message
    assert "route '*'" not in message  # its event was published
    assert "see the log" not in message


def test_an_unroutable_topic_is_named_as_such() -> None:
    with settings_with(OUTBOX_PUBLISHERS={"orders.*": MEMORY}):
        publish_committed("orders.paid")
    OutboxEvent.objects.update(topic="nowhere.at.all")  # a route removed since
    with (
        settings_with(OUTBOX_PUBLISHERS={"orders.*": MEMORY}, OUTBOX_BACKOFF_BASE_SECONDS=60),
        pytest.raises(CommandError) as raised,
    ):
        relay_command()
    assert "topic 'nowhere.at.all' (no route): 1 event, UnroutableTopic" in str(raised.value)


def test_a_database_outage_in_the_relay_command_is_a_message_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def down(self: Relay, max_batches: int | None = None) -> Any:
        raise OperationalError("could not connect to server: Connection refused")

    monkeypatch.setattr(Relay, "drain", down)
    with pytest.raises(CommandError) as raised:
        relay_command()
    message = str(raised.value)
    assert "The outbox's database 'default' failed: OperationalError: could not connect" in message
    assert "Nothing was lost" in message


def test_the_relay_reports_each_route_once_per_cause() -> None:
    with settings_with(OUTBOX_BACKOFF_BASE_SECONDS=60):
        relay = Relay()
        publish_committed("orders.paid")
        broker.fail_when(lambda message: True, BrokerUnavailable)
        relay.drain()
        publish_committed("orders.paid")
        relay.drain()
        relay.close()
    (failure,) = relay.failures()
    assert failure.route == "route '*'" and failure.failed == 2
    assert str(failure).startswith("route '*' (MemoryPublisher): 2 events, BrokerUnavailable")
