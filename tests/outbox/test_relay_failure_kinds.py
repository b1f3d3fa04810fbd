"""Publish failures by kind: a route the broker refuses (a configuration error) is told apart from
an unreachable broker and from an event's own failure, in ``last_error`` and ``failure_kind``,
in how the relay retries, and in the health panel, the admin and the metrics.

The publishers' own classification runs against the real brokers in
tests/outbox/test_publishers_nats.py (wrong credentials, a denied subject, a missing stream) and
tests/outbox/test_publishers.py (RabbitMQ's refusals, a webhook's 401/403/407).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from django_idempotency.core.failures import FailureKind
from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    PublishError,
)
from django_idempotency.models import OutboxEvent
from django_idempotency.operations import health
from django_idempotency.operations.actions import retry_events
from django_idempotency.operations.gauges import OutboxCollector
from django_idempotency.outbox import send
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import CeilingRandom, publish_committed, settings_with

pytestmark = pytest.mark.django_db(transaction=True)

CAP = 600  # OUTBOX_BACKOFF_MAX_SECONDS's default


@pytest.fixture(autouse=True)
def clean() -> Any:
    broker.clear()
    Refusing.calls.clear()
    yield
    broker.clear()


def retry_now() -> None:
    OutboxEvent.objects.pending().update(next_attempt_at=timezone.now())


@pytest.mark.parametrize(
    ("failure", "kind", "dead"),
    [
        (BrokerConfigurationError, FailureKind.CONFIGURATION, False),
        (BrokerUnavailable, FailureKind.UNREACHABLE, False),
        (PublishError, FailureKind.OTHER, True),
    ],
)
def test_each_failure_is_recorded_with_its_kind_and_only_an_events_own_goes_dead(
    failure: type[PublishError], kind: FailureKind, dead: bool
) -> None:
    event = publish_committed()
    broker.fail_when(lambda message: True, failure)
    with settings_with(OUTBOX_MAX_ATTEMPTS=2), Relay(rng=CeilingRandom()) as relay:
        for _ in range(3):
            retry_now()
            relay.run_once()
    event.refresh_from_db()
    assert event.failure_kind == kind
    assert event.last_error.startswith(f"{failure.__name__}: injected failure")
    assert (event.status == OutboxEvent.Status.DEAD) is dead


def test_a_configuration_error_is_retried_only_at_the_backoff_ceiling() -> None:
    """Not at full speed (the backoff's first steps are a second or two), and not for the
    event's sake: every attempt waits ``OUTBOX_BACKOFF_MAX_SECONDS``, without jitter."""
    event = publish_committed()
    broker.fail_when(lambda message: True, BrokerConfigurationError)
    with Relay(rng=CeilingRandom()) as relay:
        relay.run_once()
    event.refresh_from_db()
    assert event.last_failed_at is not None
    assert event.next_attempt_at - event.last_failed_at == timedelta(seconds=CAP)
    with settings_with(OUTBOX_BACKOFF_MAX_SECONDS=90), Relay() as relay:
        retry_now()
        relay.run_once()
    event.refresh_from_db()
    assert event.next_attempt_at - event.last_failed_at == timedelta(seconds=90)


def test_an_unroutable_topic_is_a_configuration_error() -> None:
    event = publish_committed("orders.paid")
    unroutable = settings_with(OUTBOX_PUBLISHERS={"invoices.*": "x.Y"}, OUTBOX_MAX_ATTEMPTS=1)
    with unroutable, Relay() as relay:
        relay.run_once()
    event.refresh_from_db()
    assert event.failure_kind == FailureKind.CONFIGURATION
    assert event.status == OutboxEvent.Status.PENDING
    assert event.last_error.startswith("UnroutableTopic: No publisher for topic 'orders.paid'")


class Refusing(Publisher):
    """Refuses every batch, as a broker refuses wrong credentials, and counts the batches."""

    calls: list[int] = []

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        Refusing.calls.append(len(messages))
        refusal = BrokerConfigurationError("the broker refused the credentials")
        return [refusal] * len(messages)


REFUSING = {"*": "tests.outbox.test_relay_failure_kinds.Refusing"}


def test_a_refused_route_is_not_asked_again_for_retries_within_the_window() -> None:
    """However large the backlog that comes due, one relay presents the refused credentials
    once per window; a new event, or one an operator retried, is always tried."""
    first = publish_committed()
    with settings_with(OUTBOX_PUBLISHERS=REFUSING), Relay() as relay:
        relay.run_once()
        assert Refusing.calls == [1]
        retry_now()
        relay.run_once()  # a retry within the window: failed without asking the broker
        assert Refusing.calls == [1]
        first.refresh_from_db()
        assert first.attempts == 2 and first.failure_kind == FailureKind.CONFIGURATION
        assert first.last_error == "BrokerConfigurationError: the broker refused the credentials"
        publish_committed(key="order-2")
        retry_events(OutboxEvent.objects.filter(pk=first.pk))
        relay.run_once()  # a new event and an operator's retry are sent
        assert Refusing.calls == [1, 2]


def test_after_the_window_a_refused_route_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(send, "REFUSED_ROUTE_SECONDS", 0.0)
    publish_committed()
    with settings_with(OUTBOX_PUBLISHERS=REFUSING), Relay() as relay:
        relay.run_once()
        retry_now()
        relay.run_once()
    assert Refusing.calls == [1, 1]


def test_an_accepted_message_ends_the_window() -> None:
    event = publish_committed()
    broker.fail_when(lambda message: True, BrokerConfigurationError)
    with Relay() as relay:
        relay.run_once()
        broker.fail_when(None)  # the route was fixed; a new event goes out and proves it
        publish_committed(key="order-2")
        assert relay.run_once().published == 1
        retry_now()
        assert relay.run_once().published == 1
    event.refresh_from_db()
    assert event.status == OutboxEvent.Status.PUBLISHED and event.failure_kind is None


def configuration_failures(count: int, **fields: Any) -> list[OutboxEvent]:
    events = [publish_committed(key=f"order-{n}") for n in range(count)]
    OutboxEvent.objects.filter(pk__in=[event.pk for event in events]).update(
        attempts=1,
        last_error="BrokerConfigurationError: NATS server refused the credentials",
        failure_kind=FailureKind.CONFIGURATION,
        **fields,
    )
    return events


def test_the_health_panel_and_the_gauge_show_configuration_errors() -> None:
    publish_committed(key="fine")
    configuration_failures(2)
    outbox = health.outbox_health()
    assert str(outbox.configuration_errors) == "2"
    (section,) = [s for s in health.snapshot() if s.model is OutboxEvent]
    (figure,) = [f for f in section.figures if f.label == "configuration errors"]
    assert figure.value == "2" and figure.alert
    assert figure.query == "status__exact=PENDING&failure_kind__exact=configuration"
    with settings_with(METRICS=True):
        families = {family.name: family for family in OutboxCollector().collect()}
    gauge = families["django_idempotency_outbox_configuration_error_events"]
    assert [sample.value for sample in gauge.samples] == [2]


def test_past_the_count_limit_the_health_figure_is_a_lower_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health, "COUNT_LIMIT", 3)
    configuration_failures(1)
    for n in range(3):
        publish_committed(key=f"later-{n}")
    assert str(health.outbox_health().configuration_errors) == "1+"


def test_the_admin_filters_and_names_configuration_errors(admin_client: Any) -> None:
    (refused,) = configuration_failures(1)
    publish_committed(key="fine")
    changelist = reverse("admin:django_idempotency_outboxevent_changelist")
    response = admin_client.get(
        f"{changelist}?status__exact=PENDING&failure_kind__exact=configuration"
    )
    assert [event.pk for event in response.context["cl"].result_list] == [refused.pk]
    assert "configuration error" in response.content.decode()
    OutboxEvent.objects.filter(pk=refused.pk).update(
        failure_fingerprint="0" * 32, last_failed_at=timezone.now()
    )
    failures = admin_client.get(reverse("admin:django_idempotency_outboxevent_failures"))
    assert "Configuration error" in failures.content.decode()
