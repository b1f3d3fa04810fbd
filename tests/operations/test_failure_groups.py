"""Failure groups below the admin: what the relay records, how groups are read, and requeueing
or discarding a group (``operations.retry_failure_group`` / ``discard_failure_group``)."""

from __future__ import annotations

import importlib
import logging
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.db import connection, connections
from django.db.models import Q
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.core.failures import fingerprint_of
from django_idempotency.exceptions import BrokerUnavailable, PublishError
from django_idempotency.models import OutboxEvent
from django_idempotency.operations import (
    EventResult,
    FailureGroupSelection,
    discard_failure_group,
    retry_events,
    retry_failure_group,
)
from django_idempotency.publishers.memory import broker
from tests.support.factories import OutboxEventFactory
from tests.support.metrics_support import SampleDelta
from tests.support.outbox_support import (
    HeldTransaction,
    database_now,
    publish_committed,
    relay_all,
    wait_for,
)

pytestmark = pytest.mark.django_db(transaction=True)

REFUSED = "PublishError: webhook https://partner.example/hooks answered 503"
UNROUTABLE = "PublishError: unroutable: no queue bound for 'refunds.issued'"


@pytest.fixture(autouse=True)
def clean():
    broker.clear()
    yield
    broker.clear()


def failed(error: str = REFUSED, *, since_minutes: float | None = 30, **fields) -> OutboxEvent:
    """An event that failed with ``error``, fingerprinted as the relay does; DEAD unless
    ``failing=True``."""
    now = timezone.now()
    if not fields.pop("failing", False):
        fields.setdefault("dead", True)
    else:
        fields["failing"] = True
    since = None if since_minutes is None else now - timedelta(minutes=since_minutes)
    return OutboxEventFactory(
        last_error=error,
        failure_fingerprint=fingerprint_of(error),
        failing_since=since,
        last_failed_at=since and now - timedelta(minutes=since_minutes / 2),
        failure_traceback="Traceback (most recent call last):\n  ...\n" + error,
        **fields,
    )


# --- what the relay records ----------------------------------------------------------------------


def test_a_failure_is_fingerprinted_once_and_its_group_clock_kept_until_the_reason_changes():
    event = publish_committed(key="order-1")
    broker.fail_when(lambda message: True)
    relay_all()
    event.refresh_from_db()
    first_fingerprint, since = event.failure_fingerprint, event.failing_since
    assert first_fingerprint == fingerprint_of(event.last_error)
    assert event.last_error == f"PublishError: injected failure for {event.event_id}"
    assert since is not None and event.last_failed_at == since
    assert abs(since - database_now()) < timedelta(minutes=1)
    assert "Traceback (most recent call last):" in event.failure_traceback
    assert event.failure_traceback.rstrip().endswith(event.last_error.split(": ", 1)[1])

    # The same failure again: same group, same start, later last failure.
    OutboxEvent.objects.filter(pk=event.pk).update(next_attempt_at=timezone.now())
    relay_all()
    event.refresh_from_db()
    assert event.attempts == 2
    assert (event.failure_fingerprint, event.failing_since) == (first_fingerprint, since)
    assert event.last_failed_at > since

    # Another reason: another group, whose clock starts now.
    broker.fail_when(lambda message: True, failure=BrokerUnavailable)
    OutboxEvent.objects.filter(pk=event.pk).update(next_attempt_at=timezone.now())
    relay_all()
    event.refresh_from_db()
    assert event.failure_fingerprint == fingerprint_of(event.last_error) != first_fingerprint
    assert event.failing_since == event.last_failed_at > since

    # Published at last: in no group any more.
    broker.clear()
    OutboxEvent.objects.filter(pk=event.pk).update(next_attempt_at=timezone.now())
    relay_all()
    event.refresh_from_db()
    assert event.status == "PUBLISHED" and event.last_error == ""
    assert (event.failure_fingerprint, event.failing_since, event.failure_traceback) == (
        None,
        None,
        None,
    )


def test_events_failing_for_the_same_reason_share_a_group_whatever_their_ids():
    events = [publish_committed(payload={"n": n}) for n in range(3)]
    broker.fail_when(lambda message: True)
    relay_all()
    fingerprints = set(
        OutboxEvent.objects.filter(pk__in=[e.pk for e in events]).values_list(
            "failure_fingerprint", flat=True
        )
    )
    assert len(fingerprints) == 1 and None not in fingerprints


def test_an_error_returned_unraised_is_grouped_without_a_traceback():
    event = publish_committed()
    broker.fail_when(lambda message: True)
    # A publisher's publish_many may return its errors rather than raise them (the AMQP one does).
    from django_idempotency.publishers.memory import MemoryPublisher

    original = MemoryPublisher.publish_many
    MemoryPublisher.publish_many = lambda self, messages: [  # type: ignore[method-assign]
        BrokerUnavailable("AMQP broker unreachable") for _ in messages
    ]
    try:
        relay_all()
    finally:
        MemoryPublisher.publish_many = original  # type: ignore[method-assign]
    event.refresh_from_db()
    assert event.failure_fingerprint == fingerprint_of("BrokerUnavailable: AMQP broker unreachable")
    assert event.failure_traceback is None


# --- reading groups ------------------------------------------------------------------------------


def test_groups_count_their_failed_events_only_most_recently_seen_first():
    old = [failed(topic="orders.paid", since_minutes=120) for _ in range(2)]
    failed(topic="invoices.sent", failing=True, since_minutes=60)
    recent = failed(UNROUTABLE, topic="refunds.issued", since_minutes=4)
    failed(UNROUTABLE, topic="refunds.issued", since_minutes=None)  # fingerprinted by upgrade
    # Not failed any more, though an earlier version left the fingerprint: not counted.
    OutboxEventFactory(
        published=True, failure_fingerprint=fingerprint_of(REFUSED), last_error=REFUSED
    )
    OutboxEventFactory(attempts=0, failure_fingerprint=fingerprint_of(REFUSED))
    OutboxEventFactory(dead=True)  # failed before fingerprints: in no group

    groups = list(OutboxEvent.objects.failure_groups())
    assert [group["failure_fingerprint"] for group in groups] == [
        fingerprint_of(UNROUTABLE),
        fingerprint_of(REFUSED),
    ]
    unroutable, refused = groups
    assert (unroutable["events"], unroutable["dead"], unroutable["topics"]) == (2, 2, 1)
    assert unroutable["topic"] == "refunds.issued"
    assert unroutable["first_seen"] == recent.failing_since
    assert unroutable["last_seen"] == recent.last_failed_at
    assert (refused["events"], refused["dead"], refused["topics"]) == (3, 2, 2)
    assert refused["topic"] == "invoices.sent"  # the first by name
    assert refused["first_seen"] == old[0].failing_since
    # A group whose failures' times are all unknown sorts last.
    OutboxEvent.objects.filter(failure_fingerprint=fingerprint_of(UNROUTABLE)).update(
        last_failed_at=None
    )
    assert list(OutboxEvent.objects.failure_groups())[-1]["last_seen"] is None


# --- acting on a group ---------------------------------------------------------------------------


def test_requeue_a_group_sends_its_events_again_and_nothing_else():
    group = [failed(), failed(failing=True), failed(leased=True, failing=True)]
    other = failed(UNROUTABLE)
    fresh = OutboxEventFactory()
    result = retry_failure_group(FailureGroupSelection(fingerprint_of(REFUSED)))
    assert result == EventResult(changed=2, in_flight=1)
    for event in group[:2]:
        event.refresh_from_db()
        assert (event.status, event.attempts, event.failure_fingerprint) == ("PENDING", 0, None)
        assert event.failing_since is None and event.last_error == REFUSED  # kept, for history
    assert OutboxEvent.objects.get(pk=other.pk).status == "DEAD"
    assert OutboxEvent.objects.get(pk=group[2].pk).attempts == 2  # a relay is publishing it
    relay_all()
    assert {m.event_id for m in broker.snapshot()} == {
        group[0].event_id,
        group[1].event_id,
        fresh.event_id,
    }


def test_discard_a_filtered_part_of_a_group():
    dead_paid = failed(topic="orders.paid")
    failing_paid = failed(topic="orders.paid", failing=True)
    dead_sent = failed(topic="invoices.sent")
    fingerprint = fingerprint_of(REFUSED)
    part = FailureGroupSelection(fingerprint, topic="orders.paid", state="dead")
    assert discard_failure_group(part) == EventResult(changed=1)
    assert set(OutboxEvent.objects.values_list("pk", flat=True)) == {
        failing_paid.pk,
        dead_sent.pk,
    }
    assert not OutboxEvent.objects.filter(pk=dead_paid.pk).exists()
    retrying = FailureGroupSelection(fingerprint, state="retrying")
    assert retry_failure_group(retrying) == EventResult(changed=1)
    assert OutboxEvent.objects.get(pk=dead_sent.pk).status == "DEAD"


def test_a_group_acted_on_as_it_was_shown_leaves_alone_what_joined_it_since():
    """The admin passes the database time at which it showed the group: events that joined the
    group after that (or failed again after a retry) were not shown and are not touched."""
    shown = failed(since_minutes=30)
    from_the_upgrade = failed(since_minutes=None)  # failure time unknown: counts as shown
    seen_at = database_now()
    joined = failed(since_minutes=-1)  # failing_since after seen_at
    result = retry_failure_group(FailureGroupSelection(fingerprint_of(REFUSED), seen_at=seen_at))
    assert result.changed == 2
    assert OutboxEvent.objects.get(pk=shown.pk).status == "PENDING"
    assert OutboxEvent.objects.get(pk=from_the_upgrade.pk).status == "PENDING"
    assert OutboxEvent.objects.get(pk=joined.pk).status == "DEAD"


def test_a_filter_is_judged_again_on_the_locked_row():
    """``matching`` decides on the row as it is once locked; what no longer matches is counted."""
    in_group = failed()
    other = failed(UNROUTABLE)
    result = retry_events(
        OutboxEvent.objects.all(), matching=Q(failure_fingerprint=fingerprint_of(REFUSED))
    )
    assert result == EventResult(changed=1, not_matching=1)
    assert OutboxEvent.objects.get(pk=in_group.pk).status == "PENDING"
    assert OutboxEvent.objects.get(pk=other.pk).status == "DEAD"


@pytest.mark.concurrency
def test_an_event_that_leaves_the_group_while_the_requeue_waits_for_it_is_left_alone():
    """A relay's ack fails an event of the group again, for another reason, while the operator's
    requeue waits for the row lock: once the ack commits, the requeue sees the event outside the
    group and leaves it alone, and requeues the rest."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: its writers are serialised whole")
    moving, staying = failed(failing=True), failed(failing=True)
    other_reason = fingerprint_of(UNROUTABLE)
    with HeldTransaction(
        lambda: (
            OutboxEvent.objects.select_for_update()
            .filter(pk=moving.pk)
            .update(failure_fingerprint=other_reason, last_error=UNROUTABLE, attempts=3)
        )
    ) as ack:
        results: list[EventResult] = []

        def requeue() -> None:
            try:
                selection = FailureGroupSelection(fingerprint_of(REFUSED))
                results.append(retry_failure_group(selection, batch_size=10))
            finally:
                connections.close_all()

        requeueing = threading.Thread(target=requeue)
        requeueing.start()
        requeueing.join(1)
        assert requeueing.is_alive(), "the requeue did not wait for the ack's row lock"
        ack.release()
        requeueing.join(60)
    wait_for(lambda: results, what="the requeue")
    assert results[0].changed == 1
    moving.refresh_from_db()
    assert (moving.failure_fingerprint, moving.attempts) == (other_reason, 3)
    staying.refresh_from_db()
    assert (staying.status, staying.attempts) == ("PENDING", 0)


def test_a_large_group_is_changed_in_batches():
    from django.test.utils import CaptureQueriesContext

    for _ in range(7):
        failed()
    with CaptureQueriesContext(connection) as queries:
        result = retry_failure_group(FailureGroupSelection(fingerprint_of(REFUSED)), batch_size=3)
    assert result.changed == 7
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 3  # one short transaction per batch of at most 3 rows


# --- logged and counted --------------------------------------------------------------------------


def test_group_actions_are_announced_logged_and_counted(caplog):
    failed(), failed(), failed(UNROUTABLE)
    metrics = SampleDelta(
        {
            name: (f"django_idempotency_outbox_operator_{kind}_total", labels)
            for kind in ("actions", "events")
            for name, labels in (
                (f"{kind}_retry_group", {"action": "retry", "target": "failure_group"}),
                (f"{kind}_discard_group", {"action": "discard", "target": "failure_group"}),
                (f"{kind}_discard_selection", {"action": "discard", "target": "selection"}),
            )
        }
    )
    seen: list[tuple[str, int, str | None]] = []

    def on_retried(sender, *, count, failure_group, **kwargs):
        seen.append(("retried", count, failure_group))

    def on_discarded(sender, *, count, failure_group, **kwargs):
        seen.append(("discarded", count, failure_group))

    signals.events_retried.connect(on_retried)
    signals.events_discarded.connect(on_discarded)
    caplog.set_level(logging.INFO, logger="django_idempotency.operations.actions")
    try:
        refused, unroutable = fingerprint_of(REFUSED), fingerprint_of(UNROUTABLE)
        retry_failure_group(FailureGroupSelection(refused))
        discard_failure_group(FailureGroupSelection(unroutable))
        from django_idempotency.operations import discard_events

        discard_events(OutboxEvent.objects.none())
    finally:
        signals.events_retried.disconnect(on_retried)
        signals.events_discarded.disconnect(on_discarded)
    assert seen == [("retried", 2, refused), ("discarded", 1, unroutable), ("discarded", 0, None)]
    assert metrics.delta() == {
        "actions_retry_group": 1,
        "events_retry_group": 2,
        "actions_discard_group": 1,
        "events_discard_group": 1,
        "actions_discard_selection": 1,
    }
    logged = [(r.getMessage(), r.outbox_failure_group) for r in caplog.records]
    assert logged == [
        ("outbox: 2 failed events queued for retry", refused),
        ("outbox: 1 failed events discarded", unroutable),
    ]


# --- the migration -------------------------------------------------------------------------------


def test_the_migration_groups_events_that_failed_before_it():
    migration = importlib.import_module(
        "django_idempotency.migrations.0005_failure_groups_failures"
    )
    dead = OutboxEventFactory(dead=True, last_error=REFUSED)
    failing = OutboxEventFactory(failing=True, last_error=UNROUTABLE)
    published = OutboxEventFactory(published=True, last_error="")
    retried = OutboxEventFactory(attempts=0, last_error=REFUSED)  # retried, not failed again
    untouched = failed(UNROUTABLE)
    before = OutboxEvent.objects.get(pk=untouched.pk)
    migration.fingerprint_failed_events(apps, SimpleNamespace(connection=connection))
    fingerprints = dict(OutboxEvent.objects.values_list("pk", "failure_fingerprint"))
    assert fingerprints[dead.pk] == fingerprint_of(REFUSED)
    assert fingerprints[failing.pk] == fingerprint_of(UNROUTABLE)
    assert fingerprints[published.pk] is None and fingerprints[retried.pk] is None
    assert OutboxEvent.objects.get(pk=dead.pk).failing_since is None  # unknown
    after = OutboxEvent.objects.get(pk=untouched.pk)
    assert (after.failure_fingerprint, after.failing_since) == (
        before.failure_fingerprint,
        before.failing_since,
    )
    # The same group as the relay's fingerprint for the same failure from now on.
    assert {group["failure_fingerprint"] for group in OutboxEvent.objects.failure_groups()} == {
        fingerprint_of(REFUSED),
        fingerprint_of(UNROUTABLE),
    }


def test_relay_and_failure_errors_fingerprint_alike():
    error = PublishError("webhook https://partner.example/hooks answered 503")
    from django_idempotency.core.failures import failure_fingerprint

    assert failure_fingerprint(error) == fingerprint_of(REFUSED)
