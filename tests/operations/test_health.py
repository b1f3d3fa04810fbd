"""Bounded counts, planner estimates and the health sections."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from django_idempotency.admin import EstimatingPaginator
from django_idempotency.models import IdempotencyRecord, OutboxEvent
from django_idempotency.operations import health
from tests.support.factories import IdempotencyRecordFactory, OutboxEventFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        (health.RowCount(1234, "exact"), "1,234"),
        (health.RowCount(1_000_412, "estimate"), "~1,000,412"),
        (health.RowCount(10_000, "at_least"), "10,000+"),
    ],
)
def test_row_counts_read_as_exact_estimated_or_at_least(count, shown):
    assert str(count) == shown


def test_counts_exactly_up_to_the_limit():
    IdempotencyRecordFactory.create_batch(3)
    assert health.count_rows(IdempotencyRecord.objects.all(), limit=3) == health.RowCount(
        3, "exact"
    )


def test_above_the_limit_postgresql_estimates_and_others_show_a_lower_bound():
    IdempotencyRecordFactory.create_batch(4)
    count = health.count_rows(IdempotencyRecord.objects.all(), limit=3)
    if connection.vendor == "postgresql":
        assert count.kind == "estimate"
        assert count.value >= 4
    else:
        assert count == health.RowCount(3, "at_least")
        assert str(count) == "3+"


def test_planner_estimate_only_on_postgresql():
    estimate = health.planner_estimate(IdempotencyRecord.objects.filter(status="COMPLETED"))
    if connection.vendor == "postgresql":
        assert isinstance(estimate, int) and estimate >= 0
    else:
        assert estimate is None


def test_paginator_is_exact_below_the_limit_and_never_counts_everything_on_postgresql(
    monkeypatch,
):
    IdempotencyRecordFactory.create_batch(5)
    records = IdempotencyRecord.objects.order_by("pk")
    assert EstimatingPaginator(records, 2).count == 5
    monkeypatch.setattr(health, "COUNT_LIMIT", 3)
    count = EstimatingPaginator(records, 2).count
    if connection.vendor == "postgresql":
        assert count == max(4, health.planner_estimate(records) or 0)
    else:
        assert count == 5  # no estimate here: an exact count is the honest answer


def test_paginator_accepts_plain_lists():
    assert EstimatingPaginator([1, 2, 3], 2).count == 3


def test_records_section():
    now = timezone.now()
    IdempotencyRecordFactory.create_batch(2)
    IdempotencyRecordFactory(stuck=True, lease_expires_at=now - timedelta(hours=3))
    IdempotencyRecordFactory(stuck=True)
    IdempotencyRecordFactory(running=True)
    IdempotencyRecordFactory(expired=True)
    section = health.records_section(now)
    assert section.model is IdempotencyRecord
    assert [(f.label, f.value, f.query, f.alert) for f in section.figures] == [
        ("processing", "3", "status__exact=PROCESSING", False),
        ("completed", "3", "status__exact=COMPLETED", False),
        ("stuck", "2", "stuck=yes", True),
        ("stuck for", "3\xa0hours", "stuck=yes", True),
        ("expired, awaiting sweep", "1", "expired=yes", False),
    ]


def test_a_healthy_table_raises_no_alert():
    IdempotencyRecordFactory(running=True)
    figures = health.records_section(timezone.now()).figures
    assert not any(figure.alert for figure in figures)
    assert {f.label: f.value for f in figures}["stuck for"] == "–"


def test_elapsed_reads_well():
    now = timezone.now()
    assert health.elapsed(now - timedelta(seconds=42), now) == "42 s"
    assert health.elapsed(now - timedelta(days=2, hours=1), now) == "2\xa0days"
    assert health.elapsed(None, now) == "–"


def test_sections_are_extensible(monkeypatch, admin_client):
    def extra(now):
        return health.Section("Outbox", IdempotencyRecord, (health.Figure("dead", "7", "x=1"),))

    monkeypatch.setattr(health, "SECTIONS", [*health.SECTIONS, extra])
    response = admin_client.get(reverse("admin:django_idempotency_idempotencyrecord_changelist"))
    html = response.content.decode()
    assert "Outbox" in html
    assert '<span class="value">7</span>' in html


# --- the outbox section -------------------------------------------------------------------------


def test_outbox_section():
    now = timezone.now()
    OutboxEventFactory(created_at=now - timedelta(minutes=5))
    OutboxEventFactory.create_batch(2, failing=True)
    OutboxEventFactory.create_batch(3, dead=True)
    OutboxEventFactory.create_batch(4, published=True)
    OutboxEventFactory(misconfigured=True)
    section = health.outbox_section(now)
    assert section.model is OutboxEvent
    assert [(f.label, f.value, f.query, f.alert) for f in section.figures] == [
        ("pending", "4", "status__exact=PENDING", False),
        ("oldest pending", "5\xa0minutes", "status__exact=PENDING", True),
        ("dead", "3", "status__exact=DEAD", True),
        ("held behind failed events", "0", "status__exact=HELD", False),
        (
            "configuration errors",
            "1",
            "status__exact=PENDING&failure_kind__exact=configuration",
            True,
        ),
    ]


def test_a_healthy_outbox_raises_no_alert():
    now = timezone.now()
    OutboxEventFactory(created_at=now - timedelta(seconds=3))
    OutboxEventFactory(published=True, created_at=now - timedelta(days=3))
    figures = {f.label: f for f in health.outbox_section(now).figures}
    assert figures["oldest pending"].value == "3 s"
    assert not any(figure.alert for figure in figures.values())
    OutboxEvent.objects.all().delete()
    figures = {f.label: f for f in health.outbox_section(now).figures}
    assert (figures["pending"].value, figures["oldest pending"].value) == ("0", "–")


def test_oldest_pending_waits_longer_than_a_relay_lease_before_it_alerts(idempotency_settings):
    now = timezone.now()
    OutboxEventFactory(created_at=now - timedelta(seconds=90))
    assert {f.label: f.alert for f in health.outbox_section(now).figures}["oldest pending"]
    idempotency_settings(OUTBOX_RELAY_LEASE_SECONDS=120)
    assert not {f.label: f.alert for f in health.outbox_section(now).figures}["oldest pending"]


def test_the_oldest_pending_event_is_found_at_the_head_of_the_relay_order(monkeypatch):
    """Only the first OLDEST_PENDING_SAMPLE events in relay order are read, not the backlog."""
    now = timezone.now()
    monkeypatch.setattr(health, "OLDEST_PENDING_SAMPLE", 2)
    head = [OutboxEventFactory(created_at=now - timedelta(minutes=m)) for m in (7, 9)]
    OutboxEventFactory(created_at=now - timedelta(hours=1))  # third in line: not read
    assert health.outbox_health().oldest_pending_at == head[1].created_at
    OutboxEvent.objects.filter(pk=head[0].pk).update(status="PUBLISHED")
    assert health.outbox_health().oldest_pending_at == now - timedelta(hours=1)


def test_outbox_counts_stay_bounded(monkeypatch):
    OutboxEventFactory.create_batch(4)
    OutboxEventFactory.create_batch(4, dead=True)
    monkeypatch.setattr(health, "COUNT_LIMIT", 3)
    outbox = health.outbox_health()
    for count in (outbox.pending, outbox.dead):
        if connection.vendor == "postgresql":
            assert count.kind == "estimate" and count.value >= 4
        else:
            assert count == health.RowCount(3, "at_least")
