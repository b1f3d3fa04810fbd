"""The default OUTBOX_KICK without Celery relays in a thread of the process, and says so once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.db import transaction

from django_idempotency import tasks
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import settings_with

KICK = "django_idempotency.tasks.kick_relay"


@pytest.fixture
def without_celery(monkeypatch: pytest.MonkeyPatch) -> tasks._RelayKicker:
    """tasks.py as it is when ``import celery`` fails, with a kicker of its own."""
    monkeypatch.setattr(tasks, "_shared_task", None)
    kicker = tasks._RelayKicker()
    monkeypatch.setattr(tasks, "_kicker", kicker)
    broker.clear()
    yield kicker
    broker.clear()


def publish_and_commit(name: str) -> OutboxEvent:
    with transaction.atomic():
        return publish("widgets.created", {"name": name})


@pytest.mark.django_db(transaction=True)  # the kick runs on commit, in a thread of its own
def test_the_default_kick_relays_in_process_without_celery(
    without_celery: tasks._RelayKicker, caplog: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="django_idempotency.tasks")
    with settings_with(OUTBOX_KICK=KICK):
        first = publish_and_commit("first")
        assert without_celery.idle.wait(30)
        second = publish_and_commit("second")
        assert without_celery.idle.wait(30)
    assert [message.event_id for message in broker.snapshot()] == [
        first.event_id,
        second.event_id,
    ]
    statuses = set(OutboxEvent.objects.values_list("status", flat=True))
    assert statuses == {OutboxStatus.PUBLISHED}
    warnings = [record for record in caplog.records if record.name == "django_idempotency.tasks"]
    assert len(warnings) == 1  # the first kick says it, the second does not repeat it
    assert "Celery is not installed" in warnings[0].getMessage()
    assert "OUTBOX_KICK" in warnings[0].getMessage()


@pytest.mark.django_db(transaction=True)
def test_the_relay_thread_runs_off_the_committing_thread(
    without_celery: tasks._RelayKicker, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    relayed_in: list[str] = []
    relay_here = tasks._relay_here

    def recording(using: str) -> None:
        relayed_in.append(threading.current_thread().name)
        relay_here(using)

    monkeypatch.setattr(tasks, "_relay_here", recording)
    with settings_with(OUTBOX_KICK=KICK):
        publish_and_commit("threaded")
        assert without_celery.idle.wait(30)
    assert relayed_in == ["django-idempotency-relay-kick"]
    assert len(broker.snapshot()) == 1


@pytest.mark.django_db(transaction=True)
def test_a_failing_in_process_relay_is_logged_and_the_thread_keeps_going(
    without_celery: tasks._RelayKicker, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    calls: list[str] = []

    def broken(using: str) -> None:
        calls.append(using)
        raise ConnectionError("database away")

    monkeypatch.setattr(tasks, "_relay_here", broken)
    caplog.set_level(logging.WARNING, logger="django_idempotency.tasks")
    with settings_with(OUTBOX_KICK=KICK):
        publish_and_commit("one")
        assert without_celery.idle.wait(30)
        publish_and_commit("two")
        assert without_celery.idle.wait(30)
    assert calls == ["default", "default"]
    assert caplog.text.count("outbox relay kick failed") == 2
