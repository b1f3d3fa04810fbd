"""Bounded counts, planner estimates and the health sections."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from django_idempotency import health
from django_idempotency.admin import EstimatingPaginator
from django_idempotency.models import IdempotencyRecord
from tests.factories import IdempotencyRecordFactory

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
