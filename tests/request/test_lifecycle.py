"""The state machine through the lifecycle and the record store, every row of DESIGN.md, on
every backend. Time passes by ageing records (``age_record``): leases are judged by the
database's clock, which freezegun does not move."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.http import HttpResponse, StreamingHttpResponse

from django_idempotency import signals
from django_idempotency.core.types import Conflict, Lease, Mismatch, Proceed, Replay, StoredResponse
from django_idempotency.exceptions import LeaseLostConflict
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import lifecycle, store
from tests.support.factories import age_record, held_elsewhere, identity
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


def proceed(ident) -> Lease:
    decision = lifecycle.claim(ident)
    assert isinstance(decision, Proceed), decision
    return decision.lease


def created(status: int = 201, body: bytes = b'{"ok": true}') -> HttpResponse:
    response = HttpResponse(body, status=status, content_type="application/json")
    response["Location"] = "/widgets/1"
    response["Set-Cookie"] = "sessionid=secret"
    response["Authorization"] = "Bearer secret"
    response["X-Widget-Id"] = "1"
    response["X-Unlisted"] = "no"
    return response


def make_widget_view(name: str, response: HttpResponse | None = None):
    def view() -> HttpResponse:
        Widget.objects.create(name=name)
        return response if response is not None else created()

    return view


def test_absent_key_is_claimed_with_a_lease(claim_path):
    ident = identity()
    lease = proceed(ident)
    record = IdempotencyRecord.objects.get(scope=ident.scope, key=ident.key)
    assert record.status == "PROCESSING"
    assert record.owner_token == lease.owner_token
    assert lease.attempt == record.attempts == 1
    assert record.lease_expires_at == lease.expires_at
    assert record.lease_expires_at - record.created_at == timedelta(seconds=30)
    assert record.expires_at - record.created_at == timedelta(seconds=30 + 86400)
    assert (record.method, record.path, record.fingerprint) == (
        ident.method,
        ident.path,
        ident.fingerprint,
    )


def test_completed_key_replays_status_allowed_headers_and_exact_body(claim_path):
    ident = identity()
    lease = proceed(ident)
    body = b'{"b": 2,  "a": [1, 2, "\xc3\xa9"]}'
    lifecycle.run(lease, make_widget_view("w", created(201, body)))
    decision = lifecycle.claim(ident)
    assert isinstance(decision, Replay)
    assert decision.response == StoredResponse(
        status=201,
        headers=[
            ("Content-Type", "application/json"),
            ("Location", "/widgets/1"),
            ("X-Widget-Id", "1"),
        ],
        body=body,
    )
    replayed = lifecycle.replay(decision.response)
    assert replayed.content == body
    assert replayed["Idempotent-Replay"] == "true"
    assert not replayed.has_header("Set-Cookie") and not replayed.cookies
    assert not replayed.has_header("Authorization")
    assert not replayed.has_header("X-Unlisted")
    assert Widget.objects.count() == 1


def test_a_replay_carries_the_content_type_the_first_answer_sent_and_no_other():
    """Django gives every response a default Content-Type; a replay keeps the stored one, and
    has none where the first answer had none (a 204, say)."""
    typed = lifecycle.replay(StoredResponse(201, [("Content-Type", "application/json")], b"{}"))
    assert typed["Content-Type"] == "application/json"
    untyped = lifecycle.replay(StoredResponse(204, [("Location", "/w/1")], b""))
    assert not untyped.has_header("Content-Type")
    assert untyped["Location"] == "/w/1" and untyped["Idempotent-Replay"] == "true"
    lower = lifecycle.replay(StoredResponse(201, [("content-type", "text/csv")], b"a,b"))
    assert lower["Content-Type"] == "text/csv"  # a name stored in another case is still its own


def test_running_key_conflicts_with_seconds_left_on_the_lease(claim_path):
    ident = identity()
    with held_elsewhere(ident):
        age_record(ident.scope, ident.key, 10.5)
        decision = lifecycle.claim(ident)
    assert decision == Conflict(retry_after=20)


@pytest.mark.parametrize("state", ["processing", "completed"])
def test_other_fingerprint_is_a_mismatch(claim_path, state):
    ident = identity()
    lease = proceed(ident)
    if state == "completed":
        lifecycle.run(lease, make_widget_view("w"))
    other = identity(key=ident.key, fingerprint="e" * 64)
    assert lifecycle.claim(other) == Mismatch()


def test_expired_lease_is_taken_over_with_a_new_owner(claim_path):
    ident = identity()
    taken_over = []
    signals.key_taken_over.connect(lambda **kw: taken_over.append(kw), dispatch_uid="t", weak=False)
    try:
        first = proceed(ident)
        age_record(ident.scope, ident.key, 31)
        second = proceed(ident)
    finally:
        signals.key_taken_over.disconnect(dispatch_uid="t")
    assert second.attempt == 2 and second.taken_over
    assert second.owner_token != first.owner_token
    record = IdempotencyRecord.objects.get(key=ident.key)
    assert record.owner_token == second.owner_token and record.attempts == 2
    assert taken_over == [
        {"signal": signals.key_taken_over, "sender": IdempotencyRecord, "scope": ident.scope,
         "key": ident.key, "attempt": 2}
    ]  # fmt: skip


def test_expired_lease_with_another_fingerprint_is_still_a_mismatch(claim_path):
    ident = identity()
    proceed(ident)
    age_record(ident.scope, ident.key, 31)
    decision = lifecycle.claim(identity(key=ident.key, fingerprint="e" * 64))
    assert decision == Mismatch()


def test_completed_record_past_ttl_counts_as_absent(claim_path):
    ident = identity()
    lifecycle.run(proceed(ident), make_widget_view("first"))
    age_record(ident.scope, ident.key, 86400 - 1)
    assert isinstance(lifecycle.claim(ident), Replay)
    age_record(ident.scope, ident.key, 2)
    # Past the TTL the key is free again, even for another request.
    lease = proceed(identity(key=ident.key, fingerprint="e" * 64))
    assert lease.attempt == 1
    record = IdempotencyRecord.objects.get(key=ident.key)
    assert (record.status, record.fingerprint, record.response_body) == (
        "PROCESSING",
        "e" * 64,
        None,
    )


def test_abandoned_processing_record_past_ttl_counts_as_absent(claim_path):
    ident = identity()
    proceed(ident)
    age_record(ident.scope, ident.key, 30 + 86400 + 1)
    lease = proceed(identity(key=ident.key, fingerprint="e" * 64))
    assert lease.attempt == 1


def test_completion_after_a_takeover_is_fenced_off(claim_path):
    ident = identity()
    slow = proceed(ident)
    age_record(ident.scope, ident.key, 31)
    fast = proceed(ident)
    with pytest.raises(LeaseLostConflict):
        lifecycle.run(slow, make_widget_view("slow"))
    lifecycle.run(fast, make_widget_view("fast"))
    assert list(Widget.objects.values_list("name", flat=True)) == ["fast"]
    record = IdempotencyRecord.objects.get(key=ident.key)
    assert record.status == "COMPLETED" and record.owner_token == fast.owner_token


def test_exception_in_view_rolls_back_and_releases_the_key(claim_path):
    ident = identity()
    lease = proceed(ident)

    def failing_view() -> HttpResponse:
        Widget.objects.create(name="doomed")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        lifecycle.run(lease, failing_view)
    assert not Widget.objects.exists()
    assert not IdempotencyRecord.objects.filter(key=ident.key).exists()
    assert proceed(ident).attempt == 1  # the client may retry at once


def test_server_error_response_is_not_stored_and_releases_the_key(claim_path):
    ident = identity()
    response = lifecycle.run(proceed(ident), make_widget_view("doomed", created(status=503)))
    assert response.status_code == 503 and response["Idempotent-Replay"] == "false"
    assert not Widget.objects.exists()
    assert not IdempotencyRecord.objects.filter(key=ident.key).exists()


def test_stored_status_codes_decide_what_is_final(claim_path, idempotency_settings):
    idempotency_settings(STORED_STATUS_CODES=[200, 201, 500])
    ident = identity()
    lifecycle.run(proceed(ident), make_widget_view("kept", created(status=500)))
    decision = lifecycle.claim(ident)
    assert isinstance(decision, Replay) and decision.response.status == 500
    assert Widget.objects.count() == 1


def test_streaming_response_completes_without_its_body(claim_path):
    ident = identity()

    def streaming_view():
        Widget.objects.create(name="streamed")
        return StreamingHttpResponse(iter([b"a", b"b"]), status=200)

    response = lifecycle.run(proceed(ident), streaming_view)
    assert b"".join(response.streaming_content) == b"ab"
    decision = lifecycle.claim(ident)
    assert isinstance(decision, Replay)
    assert not decision.response.retained
    replayed = lifecycle.replay(decision.response)
    assert replayed.status_code == 200
    assert replayed["Content-Type"] == "application/problem+json"
    assert b"response_not_retained" in replayed.content
    assert Widget.objects.count() == 1


def test_oversized_response_completes_without_its_body(claim_path, idempotency_settings):
    idempotency_settings(MAX_RESPONSE_BYTES=10)
    ident = identity()
    lifecycle.run(proceed(ident), make_widget_view("big", created(body=b"x" * 11)))
    record = IdempotencyRecord.objects.get(key=ident.key)
    assert record.status == "COMPLETED" and not record.response_retained
    assert record.response_body in (b"", None) or bytes(record.response_body) == b""
    replayed = lifecycle.replay(lifecycle.claim(ident).response)
    assert replayed.status_code == 201 and replayed["Location"] == "/widgets/1"


def test_release_needs_the_owner_token(claim_path):
    ident = identity()
    lease = proceed(ident)
    impostor = Lease(ident, uuid.uuid4(), lease.expires_at, 1, lease.using)
    assert store.release(impostor) is False
    assert store.release(lease) is True
    assert not IdempotencyRecord.objects.exists()


def test_scopes_keep_the_same_key_apart(claim_path):
    mine = identity(scope="user:1", key="shared")
    theirs = identity(scope="user:2", key="shared", fingerprint="e" * 64)
    lifecycle.run(proceed(mine), make_widget_view("mine", created(body=b"mine")))
    lease = proceed(theirs)
    lifecycle.run(lease, make_widget_view("theirs", created(body=b"theirs")))
    assert lifecycle.claim(mine).response.body == b"mine"
    assert lifecycle.claim(theirs).response.body == b"theirs"


def test_keys_differing_in_case_or_trailing_space_are_different_records(claim_path):
    for key in ("abc", "ABC", "abc "):
        lifecycle.run(proceed(identity(key=key)), make_widget_view(key))
    assert IdempotencyRecord.objects.count() == 3


def test_derived_key_is_stable_across_a_takeover(claim_path):
    ident = identity(scope="user:7", key="k1")
    first = proceed(ident)
    age_record(ident.scope, ident.key, 31)
    second = proceed(ident)
    assert first.derived_key("charge") == second.derived_key("charge") == "user:7:k1:charge"
    assert first.derived_key("email") != first.derived_key("charge")
