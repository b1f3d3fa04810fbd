"""Prometheus metrics read back from the registry after real requests."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.http import HttpResponse
from django.test import override_settings
from django.utils import timezone

from django_idempotency.core import types
from django_idempotency.db.querysets import PROCESSING
from django_idempotency.exceptions import LeaseLostConflict
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations import release_records
from django_idempotency.request import lifecycle
from tests.support.factories import age_record
from tests.support.metrics_support import SampleDelta

pytestmark = pytest.mark.django_db(transaction=True)

SAMPLES = {
    "claimed": ("django_idempotency_claims_total", {"outcome": "claimed"}),
    "replayed": ("django_idempotency_claims_total", {"outcome": "replayed"}),
    "conflicted": ("django_idempotency_claims_total", {"outcome": "conflicted"}),
    "mismatched": ("django_idempotency_claims_total", {"outcome": "mismatched"}),
    "taken_over": ("django_idempotency_takeovers_total", {}),
    "lease_lost": ("django_idempotency_leases_lost_total", {}),
    "completed": ("django_idempotency_completions_total", {}),
    "released_not_stored": ("django_idempotency_releases_total", {"reason": "not_stored"}),
    "released_admin": ("django_idempotency_releases_total", {"reason": "admin"}),
    "claim_timed": ("django_idempotency_claim_duration_seconds_count", {"outcome": "claimed"}),
    "replay_timed": ("django_idempotency_claim_duration_seconds_count", {"outcome": "replayed"}),
    "claim_seconds": ("django_idempotency_claim_duration_seconds_sum", {"outcome": "claimed"}),
}


@pytest.fixture
def metrics() -> SampleDelta:
    return SampleDelta(SAMPLES)


def post(client, key, **body):
    return client.post(
        "/api/widget/", {"name": "a", **body}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )


def test_a_request_and_its_retry(client, key, metrics):
    assert post(client, key).status_code == 201
    assert post(client, key)["Idempotent-Replay"] == "true"
    delta = metrics.delta()
    claim_seconds = delta.pop("claim_seconds")
    assert delta == {
        "claimed": 1,
        "completed": 1,
        "replayed": 1,
        "claim_timed": 1,
        "replay_timed": 1,
    }
    assert 0 < claim_seconds < 30


def test_conflict_and_mismatch(client, key, metrics, idempotency_settings):
    # The record is made to look held by a running request that holds no owner lock: ask the
    # lease alone, as on SQLite.
    idempotency_settings(TAKE_OVER_DEAD_OWNERS=False)
    post(client, key)
    IdempotencyRecord.objects.filter(key=key).update(
        status=PROCESSING, lease_expires_at=timezone.now() + timedelta(seconds=60)
    )
    assert post(client, key).status_code == 409
    assert post(client, key, name="other").status_code == 422
    delta = metrics.delta()
    assert (delta["conflicted"], delta["mismatched"]) == (1, 1)


def test_takeover(client, key, metrics):
    post(client, key)
    IdempotencyRecord.objects.filter(key=key).update(
        status=PROCESSING, lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert post(client, key).status_code == 201
    delta = metrics.delta()
    assert (delta["claimed"], delta["taken_over"], delta["completed"]) == (2, 1, 2)


def test_lease_lost(key, metrics):
    """Request A overruns its lease, B takes the key over; A's completion is fenced off."""
    identity = types.Identity("anonymous", key, "f" * 64, "POST", "/api/widget/")
    first = lifecycle.claim(identity)
    assert isinstance(first, types.Proceed)
    age_record("anonymous", key, 31)
    second = lifecycle.claim(identity)
    assert isinstance(second, types.Proceed) and second.lease.taken_over
    with pytest.raises(LeaseLostConflict):
        lifecycle.run(first.lease, lambda: HttpResponse(status=201))
    assert metrics.delta()["lease_lost"] == 1


def test_releases_by_reason(client, key, metrics):
    assert post(client, key, status=503).status_code == 503  # not stored: released
    post(client, key + "-2")
    release_records(IdempotencyRecord.objects.filter(key=key + "-2"))
    delta = metrics.delta()
    assert (delta["released_not_stored"], delta["released_admin"]) == (1, 1)


def test_switched_off(client, key, metrics):
    with override_settings(IDEMPOTENCY={"METRICS": False}):
        post(client, key)
        post(client, key)
    assert metrics.delta() == {}
