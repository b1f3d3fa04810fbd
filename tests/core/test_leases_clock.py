"""Leases are measured by the database's clock, never by the web server's.

Each test moves this process's clock by minutes (freezegun) while the database keeps real time,
as a web node with a wrong clock would: it can never take over a lease that is still running,
nor keep one alive past what the database granted, nor store a record with its own idea of
"now".
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.http import HttpResponse
from django.utils import timezone
from freezegun import freeze_time

from django_idempotency.core.types import Conflict, Proceed
from django_idempotency.db import database_now
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import lifecycle, store
from tests.support.factories import age_record, held_elsewhere, identity

pytestmark = pytest.mark.django_db(transaction=True)

SKEW = timedelta(minutes=10)
#: How far apart two readings of the real clock may be on a loaded machine.
SLACK = timedelta(seconds=5)


def proceed(ident):
    decision = lifecycle.claim(ident)
    assert isinstance(decision, Proceed), decision
    return decision.lease


def test_a_node_whose_clock_runs_ahead_cannot_take_over_a_running_lease():
    ident = identity()
    with held_elsewhere(ident) as claimed:
        held = claimed.lease
        with freeze_time(timezone.now() + SKEW, tick=True):
            decision = lifecycle.claim(ident)
    assert isinstance(decision, Conflict), "a fast clock took over a running lease"
    assert 1 <= decision.retry_after <= 30
    record = IdempotencyRecord.objects.get(key=ident.key)
    assert record.owner_token == held.owner_token


def test_a_node_whose_clock_runs_behind_takes_over_an_expired_lease():
    ident = identity()
    proceed(ident)
    age_record(ident.scope, ident.key, 31)
    with freeze_time(timezone.now() - SKEW, tick=True):
        decision = lifecycle.claim(ident)
    assert isinstance(decision, Proceed) and decision.lease.taken_over


def test_the_lease_a_claim_grants_is_the_databases():
    ident = identity()
    with freeze_time(timezone.now() - SKEW, tick=True):
        lease = proceed(ident)
    assert abs(lease.expires_at - (database_now("default") + timedelta(seconds=30))) < SLACK


@pytest.mark.parametrize("skew", [SKEW, -SKEW], ids=["ahead", "behind"])
def test_the_heartbeat_extends_by_the_databases_clock(skew):
    ident = identity()
    lease = proceed(ident)
    with freeze_time(timezone.now() + skew, tick=True):
        assert store.extend(lease)
    record = IdempotencyRecord.objects.get(key=ident.key)
    expected = database_now("default") + timedelta(seconds=30)
    assert abs(record.lease_expires_at - expected) < SLACK


@pytest.mark.parametrize("skew", [SKEW, -SKEW], ids=["ahead", "behind"])
def test_completion_and_expiry_are_stamped_by_the_database(skew):
    ident = identity()
    lease = proceed(ident)
    with freeze_time(timezone.now() + skew, tick=True):
        lifecycle.run(lease, lambda: HttpResponse(b"done", status=201))
    record = IdempotencyRecord.objects.get(key=ident.key)
    now = database_now("default")
    assert abs(record.completed_at - now) < SLACK
    assert abs(record.expires_at - (now + timedelta(seconds=86400))) < SLACK


def test_the_admin_and_the_health_panel_judge_leases_by_the_databases_clock(admin_client):
    """A running lease (by the database's clock) is never shown stuck by a web node whose clock
    runs ahead: not in the list, not by the "stuck" filter, not on its page, not in the panel."""
    from django.urls import reverse

    from django_idempotency.operations import health

    ident = identity()
    with held_elsewhere(ident):
        changelist = reverse("admin:django_idempotency_idempotencyrecord_changelist")
        record = IdempotencyRecord.objects.get(key=ident.key)
        page = reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk])
        with freeze_time(timezone.now() + SKEW, tick=True):
            stuck_only = admin_client.get(changelist, {"stuck": "yes"})
            not_stuck = admin_client.get(changelist, {"stuck": "no"})
            detail = admin_client.get(page)
            sections = health.snapshot()
    assert ident.key not in stuck_only.content.decode()
    assert ident.key in not_stuck.content.decode()
    assert "Force release" in detail.content.decode()  # a running lease: only a forced release
    assert "expired" not in detail.content.decode().split("lease left")[-1][:200]
    [records] = [section for section in sections if section.model is IdempotencyRecord]
    [stuck] = [figure for figure in records.figures if str(figure.label) == "stuck"]
    assert stuck.value == "0"
