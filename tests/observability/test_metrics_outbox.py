"""Outbox, consumer and sweep metrics read back from the registry after real relay, consumer and
sweep runs; the outbox gauges read from the database at scrape time."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, connections
from django.utils import timezone
from freezegun import freeze_time
from prometheus_client import CollectorRegistry

from django_idempotency.exceptions import BrokerConfigurationError, BrokerUnavailable
from django_idempotency.inbox import consume_once
from django_idempotency.models import OutboxEvent
from django_idempotency.operations import health, sweeps
from django_idempotency.operations.gauges import OutboxCollector
from django_idempotency.publishers.memory import broker
from django_idempotency.testing import deliver_twice
from tests.support.factories import OutboxEventFactory
from tests.support.metrics_support import SampleDelta
from tests.support.outbox_support import publish_committed, relay_all, settings_with
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)

SAMPLES = {
    "published": (
        "django_idempotency_outbox_events_published_total",
        {"publisher": "MemoryPublisher"},
    ),
    "latency_count": ("django_idempotency_outbox_publish_latency_seconds_count", {}),
    "latency_sum": ("django_idempotency_outbox_publish_latency_seconds_sum", {}),
    "latency_le_1h": (
        "django_idempotency_outbox_publish_latency_seconds_bucket",
        {"le": "3600.0"},
    ),
    "failures": ("django_idempotency_outbox_publish_failures_total", {"reason": "other"}),
    "failures_configuration": (
        "django_idempotency_outbox_publish_failures_total",
        {"reason": "configuration"},
    ),
    "failures_unreachable": (
        "django_idempotency_outbox_publish_failures_total",
        {"reason": "unreachable"},
    ),
    "dead": ("django_idempotency_outbox_events_dead_total", {}),
    "duplicates_billing": (
        "django_idempotency_consumer_duplicates_skipped_total",
        {"consumer": "billing"},
    ),
    "duplicates_task": (
        "django_idempotency_consumer_duplicates_skipped_total",
        {"consumer": "tests.testapp.tasks.record_effect"},
    ),
    "swept_events": ("django_idempotency_swept_rows_total", {"sweep": "outbox_events"}),
    "swept_messages": ("django_idempotency_swept_rows_total", {"sweep": "processed_messages"}),
}


@pytest.fixture
def metrics() -> SampleDelta:
    broker.clear()
    yield SampleDelta(SAMPLES)
    broker.clear()


def test_relayed_events_are_counted_with_their_latency(metrics):
    for n in range(3):
        publish_committed(payload={"n": n})
    relay_all()
    delta = metrics.delta()
    latency = delta.pop("latency_sum")
    assert delta == {"published": 3, "latency_count": 3, "latency_le_1h": 3}
    assert 0 < latency < 3 * 60


def test_the_latency_runs_from_publish_to_the_broker(metrics):
    """An event written an hour ago (say, while the broker was down) is observed as an hour."""
    start = timezone.now()
    with freeze_time(start - timedelta(hours=2)):
        publish_committed()
    with freeze_time(start):
        relay_all()
    delta = metrics.delta()
    # Published by the database's clock, which the frozen process clock does not stop.
    assert delta["latency_count"] == 1 and 2 * 3600 <= delta["latency_sum"] < 2 * 3600 + 60
    assert "latency_le_1h" not in delta  # it falls in the +Inf bucket only


def test_failures_and_dead_events_are_counted(metrics):
    event = publish_committed()
    broker.fail_when(lambda message: message.event_id == event.event_id)
    with settings_with(OUTBOX_MAX_ATTEMPTS=2, OUTBOX_BACKOFF_BASE_SECONDS=0.001):
        for _ in range(2):
            OutboxEvent.objects.pending().update(next_attempt_at=timezone.now())
            relay_all()
    assert metrics.delta() == {"failures": 2, "dead": 1}


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (BrokerConfigurationError, "failures_configuration"),
        (BrokerUnavailable, "failures_unreachable"),
    ],
)
def test_failures_are_counted_by_reason_and_neither_reason_goes_dead(metrics, failure, reason):
    """A refused route and an unreachable broker each have a label of their own, apart from the
    failures of an event (``other``), so an alert can tell wrong credentials from an outage."""
    publish_committed()
    broker.fail_when(lambda message: True, failure)
    with settings_with(OUTBOX_MAX_ATTEMPTS=2):
        for _ in range(3):
            OutboxEvent.objects.pending().update(next_attempt_at=timezone.now())
            relay_all()
    assert metrics.delta() == {reason: 3}
    assert OutboxEvent.objects.get().status == OutboxEvent.Status.PENDING


def test_consumers_count_the_duplicates_they_skip(metrics):
    for _ in range(3):
        with consume_once("billing", "m-1") as consumption:
            if consumption:
                pass
    deliver_twice(tasks.record_effect, name="twice")
    assert metrics.delta() == {"duplicates_billing": 2, "duplicates_task": 1}


def test_sweeps_count_the_rows_they_delete(metrics):
    OutboxEventFactory.create_batch(3, published=True)
    with consume_once("billing", "old"):
        pass
    later = timezone.now() + timedelta(days=60)
    assert sweeps.sweep_published_events(now=later, batch_size=2) == 3
    assert sweeps.sweep_processed_messages(now=later) == 1
    assert metrics.delta() == {"swept_events": 3, "swept_messages": 1}


def test_switched_off(metrics):
    with settings_with(METRICS=False):
        publish_committed()
        relay_all()
        with consume_once("billing", "m-2"):
            pass
        with consume_once("billing", "m-2"):
            pass
    assert metrics.delta() == {}


# --- gauges at scrape time -----------------------------------------------------------------------


def scrape(collector: OutboxCollector) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        name: registry.get_sample_value(f"django_idempotency_outbox_{name}")
        for name in ("pending_events", "oldest_pending_age_seconds", "dead_events")
    }


def test_the_gauges_read_the_outbox_when_scraped():
    now = timezone.now()
    OutboxEventFactory(created_at=now - timedelta(minutes=5))
    OutboxEventFactory(failing=True, created_at=now - timedelta(minutes=1))
    OutboxEventFactory.create_batch(2, dead=True)
    OutboxEventFactory.create_batch(3, published=True)
    collector = OutboxCollector()
    with freeze_time(now):
        assert scrape(collector) == {
            "pending_events": 2,
            "oldest_pending_age_seconds": 300,
            "dead_events": 2,
        }
    relay_all()
    assert scrape(collector) == {
        "pending_events": 1,  # the failing one waits for its backoff
        "oldest_pending_age_seconds": pytest.approx(60, abs=30),
        "dead_events": 2,
    }
    broker.clear()


def test_an_empty_outbox_reads_zero():
    assert scrape(OutboxCollector()) == {
        "pending_events": 0,
        "oldest_pending_age_seconds": 0,
        "dead_events": 0,
    }


def test_registering_the_collector_reads_nothing(django_assert_num_queries):
    with django_assert_num_queries(0):
        CollectorRegistry().register(OutboxCollector())


def test_the_gauges_are_bounded_like_the_health_panel(monkeypatch):
    OutboxEventFactory.create_batch(5)
    monkeypatch.setattr(health, "COUNT_LIMIT", 3)
    pending = scrape(OutboxCollector())["pending_events"]
    if connection.vendor == "postgresql":
        assert pending >= 4  # the planner's estimate
    else:
        assert pending == 3  # a lower bound


def test_a_scrape_on_its_own_thread_leaves_no_connection_open():
    OutboxEventFactory()
    state = {}

    def scrape_in_thread():
        state["before"] = connections["default"].connection
        state["values"] = scrape(OutboxCollector())
        state["after"] = connections["default"].connection

    thread = threading.Thread(target=scrape_in_thread)
    thread.start()
    thread.join(60)
    assert state["before"] is None and state["after"] is None
    assert state["values"]["pending_events"] == 1
    # A connection that was open already (a request's) is left open.
    connection.ensure_connection()
    scrape(OutboxCollector())
    assert connection.connection is not None


def test_a_database_error_drops_the_gauges_not_the_scrape(monkeypatch, caplog):
    def unavailable(using=None):
        raise DatabaseError("the database is down")

    monkeypatch.setattr(health, "outbox_health", unavailable)
    registry = CollectorRegistry()
    registry.register(OutboxCollector())
    assert registry.get_sample_value("django_idempotency_outbox_pending_events") is None
    assert "outbox gauges" in caplog.text


def test_gauges_switched_off():
    OutboxEventFactory()
    with settings_with(METRICS=False):
        assert scrape(OutboxCollector())["pending_events"] is None
