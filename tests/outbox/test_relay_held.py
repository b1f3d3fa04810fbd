"""Events queued behind a failed event of their key are set aside (HELD) and come back in order
(outbox/holding.py): when the failed event is published, retried or discarded, and by the
relay's tend when nothing holds them any more. On every backend."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from django_idempotency.models import OutboxEvent
from django_idempotency.operations.actions import discard, retry_dead
from django_idempotency.outbox import holding
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import CeilingRandom, publish_committed

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def clean(idempotency_settings: Any) -> Iterator[None]:
    # A first retry a minute away: long enough to set aside what is behind a failed event.
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=60)
    broker.clear()
    yield
    broker.clear()


def sent() -> list[int]:
    return [message.payload["n"] for message in broker.snapshot()]


def statuses(key: str = "order-1") -> list[str]:
    return list(OutboxEvent.objects.filter(key=key).order_by("pk").values_list("status", flat=True))


def fail_first_then_drain(count: int = 4, **settings: Any) -> list[OutboxEvent]:
    """``count`` events on one key; the first fails once (a full backoff: not retried)."""
    events = [publish_committed(payload={"n": n}, key="order-1") for n in range(count)]
    broker.fail_when(lambda message: message.payload["n"] == 0)
    with Relay(rng=CeilingRandom()) as relay:
        relay.drain()
    broker.fail_when(None)
    return events


def due_now() -> None:
    OutboxEvent.objects.update(next_attempt_at=timezone.now())


def test_the_events_behind_a_failed_one_are_held_and_follow_it_once_it_is_published():
    fail_first_then_drain()
    assert statuses() == ["PENDING", "HELD", "HELD", "HELD"]
    publish_committed(payload={"n": 9})  # another key flows meanwhile
    with Relay() as relay:
        relay.drain()
    assert sent() == [9]  # the failed event's backoff runs: nothing of its key went
    due_now()
    with Relay() as relay:
        relay.drain()
    assert sent() == [9, 0, 1, 2, 3]
    assert set(statuses()) == {"PUBLISHED"}


def test_retrying_a_dead_event_releases_the_events_behind_it(idempotency_settings):
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=60, OUTBOX_MAX_ATTEMPTS=1)
    fail_first_then_drain(3)
    assert statuses() == ["DEAD", "HELD", "HELD"]
    assert retry_dead() == 1
    assert statuses() == ["PENDING", "PENDING", "PENDING"]
    with Relay() as relay:
        relay.drain()
    assert sent() == [0, 1, 2]


def test_discarding_a_dead_event_releases_the_events_behind_it(idempotency_settings):
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=60, OUTBOX_MAX_ATTEMPTS=1)
    fail_first_then_drain(3)
    assert discard(OutboxEvent.objects.all()) == 1
    with Relay() as relay:
        relay.drain()
    assert sent() == [1, 2]


def test_tend_sets_aside_what_arrived_behind_a_failed_event_and_releases_what_nothing_holds(
    idempotency_settings,
):
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=60, OUTBOX_MAX_ATTEMPTS=1)
    fail_first_then_drain(2)
    publish_committed(payload={"n": 2}, key="order-1")  # arrives behind the DEAD event
    assert statuses() == ["DEAD", "HELD", "PENDING"]
    with Relay() as relay:
        relay.tend()
        assert statuses() == ["DEAD", "HELD", "HELD"]
        # Deleted by hand, not discarded: nothing released its key. The next tend does.
        OutboxEvent.objects.filter(status="DEAD").delete()
        relay.tend()
        assert statuses() == ["PENDING", "PENDING"]
        relay.drain()
    assert sent() == [1, 2]


def test_the_celery_task_tends_once_a_minute_per_process(idempotency_settings, monkeypatch):
    """Deployments that relay only with the ``relay_outbox`` task tend too: the task tends before
    its pass when this process has not tended in ``TEND_SECONDS``."""
    from django_idempotency.outbox import relay as relay_module
    from django_idempotency.tasks import relay_outbox

    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=60, OUTBOX_MAX_ATTEMPTS=1)
    monkeypatch.setattr(relay_module, "_next_tend", {})
    fail_first_then_drain(2)
    publish_committed(payload={"n": 2}, key="order-1")  # arrives behind the DEAD event
    relay_outbox()
    assert statuses() == ["DEAD", "HELD", "HELD"]
    OutboxEvent.objects.filter(status="DEAD").delete()  # by hand: nothing releases the key
    relay_outbox()  # tended a moment ago: not again yet
    assert (statuses(), sent()) == (["HELD", "HELD"], [])
    monkeypatch.setattr(relay_module, "_next_tend", {connection.alias: 0.0})  # a minute later
    relay_outbox()
    assert (set(statuses()), sent()) == ({"PUBLISHED"}, [1, 2])


def test_a_held_event_keeps_the_order_even_when_released_too_early():
    """HELD is a hint: an event released while its key's failed event still waits is held back
    by the claim's order check, as it was before events were set aside."""
    fail_first_then_drain(3)
    assert holding.release(OutboxEvent.objects.all(), ["order-1"]) == 2
    with Relay() as relay:
        relay.drain()
    assert sent() == []
    due_now()
    with Relay() as relay:
        relay.drain()
    assert sent() == [0, 1, 2]


# --- tend against a relay that publishes the failed event meanwhile -----------------------------


def race_tend_against_a_relay(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[int, list[str], list[str]]:
    """A tend reads the failed event of ``order-1`` and pauses before setting aside what is
    behind it. Meanwhile a relay tries to publish that event (now due), and an event arrives
    behind it. What that relay's pass claimed, the key's statuses as the tend set aside (in its
    transaction), and after it and a drain."""
    fail_first_then_drain(1)
    due_now()
    # The tend takes the failed event for one that waits long, though it is due: no clock can
    # be moved forward here, and a due event is one a relay may claim during the tend.
    monkeypatch.setattr(holding, "HOLD_AFTER_SECONDS", -3600.0)
    read, resume = threading.Event(), threading.Event()
    real_set_aside = holding.set_aside

    def paused_set_aside(*args: Any, **kwargs: Any) -> int:
        read.set()
        assert resume.wait(30)
        count = real_set_aside(*args, **kwargs)
        seen.extend(statuses())
        return count

    monkeypatch.setattr(holding, "set_aside", paused_set_aside)
    errors: list[BaseException] = []
    seen: list[str] = []

    def tend() -> None:
        try:
            with Relay() as relay:
                relay.tend()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=tend)
    thread.start()
    try:
        assert read.wait(30), "the tend never read the failed event"
        with Relay() as relay:
            claimed = relay.run_once().claimed
        publish_committed(payload={"n": 1}, key="order-1")
    finally:
        resume.set()
        thread.join(30)
    assert not errors, errors
    monkeypatch.setattr(holding, "set_aside", real_set_aside)
    with Relay() as relay:
        relay.drain()
    return claimed, seen, statuses()


def test_a_tend_locks_the_failed_event_so_no_relay_publishes_it_meanwhile(monkeypatch):
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("SQLite takes one writer at a time: no relay claims during a tend")
    claimed, seen, after = race_tend_against_a_relay(monkeypatch)
    # The race happened: the relay's pass ran while the tend held the failed event, and
    # skipped it; the event that arrived meanwhile was set aside behind it, then followed it.
    assert claimed == 0
    assert seen == ["PENDING", "HELD"]
    assert sent() == [0, 1]
    assert after == ["PUBLISHED", "PUBLISHED"]


def test_control_without_the_lock_a_tend_sets_aside_an_event_nothing_holds(monkeypatch):
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("SQLite takes one writer at a time: no relay claims during a tend")
    monkeypatch.setattr(holding, "_locked", lambda failed, using: failed)
    claimed, seen, _ = race_tend_against_a_relay(monkeypatch)
    # The relay published the failed event and released its key before the tend set aside the
    # event that arrived behind it: HELD behind a published event, that nothing would release
    # but a tend's release of what nothing holds.
    assert claimed == 1
    assert seen == ["PUBLISHED", "HELD"]


def test_the_health_panel_and_the_gauge_count_the_held_events(idempotency_settings):
    from django_idempotency.operations import health
    from django_idempotency.operations.gauges import OutboxCollector

    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=60, METRICS=True)
    fail_first_then_drain(4)
    outbox = health.outbox_health()
    assert (outbox.held, outbox.pending) == (
        health.RowCount(3, "exact"),
        health.RowCount(1, "exact"),
    )
    gauges = {family.name: family.samples[0].value for family in OutboxCollector().collect()}
    assert gauges["django_idempotency_outbox_held_events"] == 3
    assert gauges["django_idempotency_outbox_pending_events"] == 1


def test_a_failed_event_retried_within_seconds_sets_nothing_aside(idempotency_settings):
    """Behind a short backoff the events stay PENDING: holding and releasing them would write
    each one twice, for claims that skip them only until the retry."""
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=1)
    fail_first_then_drain(3)
    assert statuses() == ["PENDING", "PENDING", "PENDING"]
    with Relay() as relay:
        relay.tend()
    assert statuses() == ["PENDING", "PENDING", "PENDING"]
