"""202 Accepted for long operations (``handoff.py``): on every door, a view hands its work to a
worker under its key, duplicates replay the 202 or wait for the final response, and the worker
runs the work once, however often it is delivered, against the real database.

The worker is ``tests/testapp/handoff.make_widget``; the tests deliver the outbox's messages to
it themselves, as a Celery worker would (``tests/request/test_idempotent_function_celery.py`` runs
one in a real worker and kills it mid-run).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client

from django_idempotency.core.statemachine import ACCEPTED, COMPLETED
from django_idempotency.models import IdempotencyRecord, OutboxEvent
from django_idempotency.request import attach
from django_idempotency.request.handoff import HAND_OFF_ARGUMENT, handed_off
from tests.testapp import handoff
from tests.testapp.models import Widget

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.support.handoff_urls"),
]

DOORS = list(handoff.DOORS)


def post(door: str, key: str | None, *, prefer: str | None = None, **body: Any) -> Any:
    headers: dict[str, str] = {}
    if key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    if prefer is not None:
        headers["HTTP_PREFER"] = prefer
    return Client(raise_request_exception=False).post(
        handoff.DOORS[door], json.dumps(body), content_type="application/json", **headers
    )


def handed_off_work() -> list[dict[str, Any]]:
    """The payloads of the hand-offs in the outbox, oldest first."""
    events = OutboxEvent.objects.filter(topic=handoff.TOPIC).order_by("id")
    return [dict(event.payload) for event in events]


def deliver(payload: dict[str, Any]) -> str:
    """One delivery of handed-off work to the worker, as a Celery worker would make it."""
    return handoff.make_widget(**payload)


def record(key: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(key=key)


@pytest.fixture(params=["records", "redis"])
def store(request: Any, settings: Any) -> str:
    """The records alone, and with the Redis copy of completed responses."""
    if request.param == "redis":
        from tests.request.test_redis_copy import configure

        configure(settings, request.getfixturevalue("redis_url"))
    return str(request.param)


@pytest.fixture(autouse=True)
def _fresh_runs() -> Iterator[None]:
    handoff.runs.clear()
    yield
    handoff.runs.clear()


@pytest.mark.parametrize("door", DOORS)
def test_a_long_operation_answers_202_and_hands_its_key_to_the_worker(door, key):
    response = post(door, key, name="w1")

    assert response.status_code == 202, response.content
    location = f"/keys/idempotency-keys/{key}"
    assert response["Location"] == location
    assert response.json() == {"key": key, "status": "processing", "status_url": location}
    assert response["Idempotent-Replay"] == "false"
    stored = record(key)
    assert stored.status == ACCEPTED and stored.response_status == 202
    # The work is enqueued with the key's owner token, in the transaction that stored the 202.
    [work] = handed_off_work()
    assert work["name"] == "w1"
    assert work[HAND_OFF_ARGUMENT]["owner_token"] == str(stored.owner_token)
    assert handoff.runs["w1"] == 0 and not Widget.objects.filter(created_by="worker").exists()
    if door == "decorator-async":
        # The async view's own write committed with the hand-off.
        assert Widget.objects.filter(created_by="view").count() == 1


@pytest.mark.parametrize("door", DOORS)
def test_a_retry_while_the_worker_runs_replays_the_202_and_enqueues_nothing(door, key):
    first = post(door, key, name="w2")
    retry = post(door, key, name="w2")

    assert retry.status_code == 202
    assert retry["Idempotent-Replay"] == "true"
    assert retry["Location"] == first["Location"] and retry.content == first.content
    assert len(handed_off_work()) == 1


@pytest.mark.parametrize("door", DOORS)
def test_the_worker_stores_the_final_response_that_retries_and_the_status_url_return(
    door, key, store
):
    post(door, key, name="w3")
    [work] = handed_off_work()

    assert deliver(work) == "completed"

    stored = record(key)
    assert stored.status == COMPLETED and stored.response_status == 201
    retry = post(door, key, name="w3")
    assert retry.status_code == 201 and retry["Idempotent-Replay"] == "true"
    widget = Widget.objects.get(created_by="worker")
    assert retry.json() == {"id": widget.pk, "name": "w3"}
    status = Client().get(f"/keys/idempotency-keys/{key}")
    assert status.json()["status"] == "completed" and status.json()["response_status"] == 201
    link = status["Link"].split(";")[0].strip("<>")
    assert Client().get(link).content == retry.content


def test_the_status_url_says_processing_while_the_worker_holds_the_key(key):
    post("decorator", key, name="w4")

    status = Client().get(f"/keys/idempotency-keys/{key}")

    assert status.status_code == 200
    assert status.json()["status"] == "processing"
    assert status.json()["response_status"] is None
    # Its stored response is not there yet: the link answers 409, as a retry would be told.
    assert Client().get(f"/keys/idempotency-keys/{key}/response").status_code == 409


def test_a_redelivery_runs_nothing(key):
    post("decorator", key, name="w5")
    [work] = handed_off_work()

    assert deliver(work) == "completed"
    assert deliver(work) == "already_completed"

    assert handoff.runs["w5"] == 1
    assert Widget.objects.filter(created_by="worker").count() == 1


def test_two_deliveries_at_once_run_the_work_once(key, tmp_path: Path):
    """The first delivery holds the key's row; the second waits for its commit, then finds
    the work done."""
    hold = tmp_path / "hold"
    hold.touch()
    post("decorator", key, name="w6", hold_file=str(hold))
    [work] = handed_off_work()
    outcomes: list[str] = []

    def run() -> None:
        try:
            outcomes.append(deliver(work))
        finally:
            connection.close()

    first = threading.Thread(target=run)
    first.start()
    deadline = time.monotonic() + 20
    while handoff.runs["w6"] == 0:
        assert time.monotonic() < deadline, "the first delivery never started"
        time.sleep(0.01)
    second = threading.Thread(target=run)
    second.start()
    time.sleep(0.3)
    hold.unlink()
    first.join(30)
    second.join(30)

    assert sorted(outcomes) == ["already_completed", "completed"]
    assert handoff.runs["w6"] == 1
    assert Widget.objects.filter(created_by="worker").count() == 1


def test_a_failing_worker_stores_nothing_and_its_retry_runs_again(key):
    post("decorator", key, name="w7", fail=True)
    [work] = handed_off_work()

    with pytest.raises(RuntimeError, match="worker failed"):
        deliver(work)

    assert record(key).status == ACCEPTED  # held still: the task's retry runs it again
    assert not Widget.objects.filter(created_by="worker").exists()  # rolled back
    assert deliver({**work, "fail": False}) == "completed"
    assert Widget.objects.filter(created_by="worker").count() == 1


def test_after_the_hold_a_retry_takes_the_key_over_and_the_old_worker_is_fenced_out(
    key, idempotency_settings
):
    idempotency_settings(HANDOFF_HOLD_SECONDS=0.5)
    post("decorator", key, name="w8")
    [old] = handed_off_work()
    time.sleep(1.0)

    retry = post("decorator", key, name="w8")

    assert retry.status_code == 202 and retry["Idempotent-Replay"] == "false"
    old_work, new_work = handed_off_work()
    assert old_work == old
    assert deliver(old_work) == "not_ours"
    assert deliver(new_work) == "completed"
    assert handoff.runs["w8"] == 1
    assert record(key).attempts == 2


def test_hand_off_per_call_hold_overrides_the_setting(key, rf):
    """``hold_seconds=`` is carried to the worker, which holds the key that long."""
    post("decorator", key, name="w9")
    [work] = handed_off_work()
    assert work[HAND_OFF_ARGUMENT]["hold_seconds"] == 3600

    ticket = {**work[HAND_OFF_ARGUMENT], "hold_seconds": 7200}
    assert deliver({**work, HAND_OFF_ARGUMENT: ticket}) == "completed"


@pytest.mark.parametrize("door", DOORS)
def test_a_request_the_view_refuses_is_answered_at_once_and_hands_nothing_off(door, key):
    """A view that answers without handing off is an ordinary request: its 400 is final."""
    refused = post(door, key, invalid=True)

    assert refused.status_code == 400
    assert record(key).status == COMPLETED and record(key).response_status == 400
    assert handed_off_work() == []


@pytest.mark.parametrize("door", ["decorator", "decorator-async", "api-function", "mixin"])
def test_a_long_running_view_requires_a_key(door):
    response = post(door, None, name="nokey")

    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["detail"]
    assert handed_off_work() == [] and not Widget.objects.exists()


def test_hand_off_without_a_key_behind_the_middleware_is_a_400(db):
    response = post("middleware", None, name="nokey")

    assert response.status_code == 400
    assert handed_off_work() == []


@pytest.mark.parametrize("notify", ["in_process", "poller"])
@pytest.mark.parametrize("door", ["decorator", "decorator-async", "mixin"])
def test_a_duplicate_that_may_wait_gets_the_workers_final_response(
    door, notify, key, monkeypatch, store
):
    """Attached to the worker: woken by the completion in this process, or (as when the
    worker is another process) by the attach poller."""
    if notify == "poller":
        monkeypatch.setattr(attach, "notify", lambda using, identity: None)
    post(door, key, name="w10")
    [work] = handed_off_work()
    answers: list[Any] = []

    def duplicate() -> None:
        try:
            answers.append(post(door, key, prefer="wait=10", name="w10"))
        finally:
            connection.close()

    waiter = threading.Thread(target=duplicate)
    waiter.start()
    deadline = time.monotonic() + 20
    while attach.waiting() == 0:
        assert time.monotonic() < deadline, "the duplicate never waited"
        time.sleep(0.005)
    assert deliver(work) == "completed"
    waiter.join(30)

    [answer] = answers
    assert answer.status_code == 201 and answer["Idempotent-Replay"] == "true"
    assert answer["Preference-Applied"] == "wait=10"


def test_a_view_that_fails_after_handing_off_enqueues_nothing(key, monkeypatch):
    """The hand-off is in the view's transaction: a view that raises after it rolls it back."""
    real = handoff.hand_off

    def hand_off_then_fail(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise RuntimeError("the view failed after handing off")

    monkeypatch.setattr(handoff, "hand_off", hand_off_then_fail)
    response = post("decorator", key, name="w11")

    assert response.status_code == 500
    assert handed_off_work() == []
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def test_a_view_that_rolls_back_after_handing_off_answers_500_not_a_false_202(key, monkeypatch):
    real = handoff.hand_off

    def hand_off_then_roll_back(*args: Any, **kwargs: Any) -> Any:
        response = real(*args, **kwargs)
        transaction.set_rollback(True)
        return response

    monkeypatch.setattr(handoff, "hand_off", hand_off_then_roll_back)
    response = post("decorator", key, name="w13")

    assert response.status_code == 500
    assert handed_off_work() == []
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def test_a_202_is_stored_even_where_the_view_stores_nothing_else(key, idempotency_settings):
    """``STORED_STATUS_CODES`` without 202: the hand-off's 202 is stored all the same, since
    its work was enqueued with it."""
    idempotency_settings(STORED_STATUS_CODES=[201])
    response = post("decorator", key, name="w14")

    assert response.status_code == 202
    assert record(key).status == ACCEPTED
    assert len(handed_off_work()) == 1


def test_a_worker_called_without_its_ticket_says_so():
    with pytest.raises(TypeError, match="without its 'idempotency_hand_off' argument"):
        handoff.make_widget(name="direct")


def test_any_json_value_is_answered_200(key):
    @handed_off
    def returns_json(name: str, **_: Any) -> dict[str, str]:
        return {"done": name}

    post("decorator", key, name="w12")
    [work] = handed_off_work()
    assert returns_json(**work) == "completed"

    retry = post("decorator", key, name="w12")
    assert retry.status_code == 200 and retry.json() == {"done": "w12"}
