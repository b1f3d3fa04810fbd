"""One run step for every door, and caches that hold only what committed.

Every door (the view doors of ``tests/testapp/doors.py``, ``@idempotent_function`` sync and
async, a handed-off worker) × every way a run ends (commit, raise, ``set_rollback``, a caught
database error, a caller's transaction rolled back around it) × every cache (none, process
memory, the Redis copy, both) gives the same outcome: a retry runs again until a run commits,
then replays it, and every answer that reports a charge has that charge committed behind it.

The named tests after the table are the cases that broke: each failed before the caches were
filled from ``on_commit`` and before the worker followed the view rules.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.test import Client

from django_idempotency.core.statemachine import ACCEPTED, COMPLETED
from django_idempotency.models import IdempotencyRecord, OutboxEvent
from django_idempotency.request import memory
from tests.request.test_lifecycle_doors import ALL as VIEW_DOORS
from tests.request.test_lifecycle_doors import send
from tests.testapp import charges, doors
from tests.testapp.charges import Declined, charged
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

CACHES = ["none", "memory", "redis", "memory+redis"]
#: How a first run ends, for the doors that run a view or a worker.
ENDINGS = ["commit", "raise", "rollback", "integrity"]


@pytest.fixture(autouse=True)
def _fresh_counts() -> Iterator[None]:
    charges.runs.clear()
    charges.worker_runs.clear()
    doors.calls.clear()
    memory.clear()
    yield
    memory.clear()


@pytest.fixture(params=CACHES)
def caches(request: Any, settings: Any, idempotency_settings: Any) -> Iterator[str]:
    """No cache, the answers kept in memory, the Redis copy, or both."""
    if "memory" in request.param:
        idempotency_settings(LOCAL_REPLAY_SECONDS=30)
    if "redis" not in request.param:
        yield request.param
        return
    from django_redis import get_redis_connection

    from tests.request.test_redis_copy import ALIAS, configure

    prefix = configure(settings, request.getfixturevalue("redis_url"))
    yield request.param
    client = get_redis_connection(ALIAS)
    for name in client.scan_iter(f"{prefix}:*"):
        client.delete(name)


def http() -> Client:
    return Client(raise_request_exception=False)


def assert_backed(answer: dict[str, Any], order: str) -> None:
    """An answer that reports a charge has that charge committed behind it."""
    widget = answer["charge"]
    assert Widget.objects.filter(pk=widget, name=f"charge-{order}").exists(), (
        f"the answer reports charge {widget}, which never committed"
    )


# --- the table ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("door", VIEW_DOORS)
def test_a_view_that_charges_then_ends_any_way_is_retried_to_exactly_one_charge(
    door: str, ending: str, caches: str, key: str
) -> None:
    """The view charges twice through the function (a helper calling it again, so the second
    call replays a record its own transaction wrote), then ends as ``ending`` says."""
    body = {"mode": f"{ending}_once", "charge": key, "charge_times": 2}
    first = send(http(), door, key, **body)
    committed = ending == "commit"
    assert first.status_code == {"commit": 201, "raise": 500}.get(ending, 409), first.content
    assert charged(key) == (1 if committed else 0)
    for attempt in range(3):
        retry = send(http(), door, key, **body)
        assert retry.status_code == 201, (attempt, retry.content)
        assert_backed(retry.json()["charge"], key)
        assert retry["Idempotent-Replay"] == ("true" if committed or attempt else "false")
    assert charged(key) == 1
    assert charges.runs[key] == (1 if committed else 2)


def _call_function(door: str) -> Callable[[str, str], dict[str, Any]]:
    if door == "function":
        return charges.charge
    return lambda order, mode: async_to_sync(charges.acharge)(order, mode)


@pytest.mark.parametrize("ending", [*ENDINGS, "outer_rollback"])
@pytest.mark.parametrize("door", ["function", "function-async"])
def test_a_function_that_ends_any_way_is_called_again_to_exactly_one_charge(
    door: str, ending: str, caches: str, key: str
) -> None:
    call = _call_function(door)
    if ending == "outer_rollback":
        with pytest.raises(Declined), transaction.atomic():
            assert_backed(call(key, "commit"), key)  # as the caller's transaction sees it
            assert call(key, "commit") == call(key, "commit")  # replays inside it
            raise Declined("the caller failed after the call")
    elif ending == "raise":
        with pytest.raises(Declined):
            call(key, "raise")
    else:
        first = call(key, ending)
        assert ("charge" in first) == (ending == "commit")
    committed = ending == "commit"
    assert charged(key) == (1 if committed else 0)
    for _ in range(3):
        assert_backed(call(key, "commit"), key)
    assert charged(key) == 1
    assert charges.runs[key] == (1 if committed else 2)
    assert IdempotencyRecord.objects.get(key=key).status == COMPLETED


def _hand_off(key: str, mode: str) -> Any:
    return http().post(
        "/doors/handoff-charge/",
        json.dumps({"order": key, "mode": mode}),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )


def _deliver_latest() -> str:
    event = OutboxEvent.objects.filter(topic=charges.TOPIC).order_by("-id").first()
    assert event is not None, "nothing was handed off"
    return str(charges.charging_worker(**event.payload))


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_handed_off_worker_that_ends_any_way_leaves_its_key_answerable(
    ending: str, caches: str, key: str
) -> None:
    """The worker charges, then ends as ``ending`` says: a raise leaves the key to the task's
    own retry; a rollback or a caught database error releases it, as for a view, so the
    client's retry hands the work off again. Never ACCEPTED after the worker ran to the end."""
    mode = f"{ending}_once"
    assert _hand_off(key, mode).status_code == 202
    if ending == "raise":
        with pytest.raises(Declined):
            _deliver_latest()
        assert IdempotencyRecord.objects.get(key=key).status == ACCEPTED
        assert charged(key) == 0
        assert _deliver_latest() == "completed"  # the task's retry
    elif ending == "commit":
        assert _deliver_latest() == "completed"
    else:
        assert _deliver_latest() == "released"
        assert not IdempotencyRecord.objects.filter(key=key, status=ACCEPTED).exists()
        assert charged(key) == 0
        assert _hand_off(key, mode).status_code == 202  # the client's retry hands off anew
        assert _deliver_latest() == "completed"
    for _ in range(3):
        retry = _hand_off(key, mode)
        assert retry.status_code == 201 and retry["Idempotent-Replay"] == "true"
        assert_backed(retry.json()["charge"], key)
    assert charged(key) == 1


# --- the cases that broke -----------------------------------------------------------------------


def test_memory_never_keeps_a_result_its_callers_transaction_rolled_back(
    key: str, idempotency_settings: Any
) -> None:
    idempotency_settings(LOCAL_REPLAY_SECONDS=30)
    with pytest.raises(Declined), transaction.atomic():
        charges.charge(key)
        raise Declined("the caller failed after the charge")
    assert charged(key) == 0 and not IdempotencyRecord.objects.exists()

    assert_backed(charges.charge(key), key)  # runs again: nothing was kept
    assert charges.runs[key] == 2


@pytest.mark.parametrize("cache", ["memory", "redis"])
def test_a_view_retried_after_its_charge_rolled_back_charges_again(
    key: str, cache: str, settings: Any, idempotency_settings: Any, redis_url: str
) -> None:
    if cache == "memory":
        idempotency_settings(LOCAL_REPLAY_SECONDS=30)
    else:
        from tests.request.test_redis_copy import configure

        configure(settings, redis_url)
    first = send(http(), "decorator", key, mode="raise_once", charge=key, charge_times=2)
    assert first.status_code == 500
    retry = send(http(), "decorator", key, mode="raise_once", charge=key, charge_times=2)
    assert retry.status_code == 201
    assert_backed(retry.json()["charge"], key)


def test_redis_never_copies_a_record_its_own_transaction_wrote(
    key: str, settings: Any, redis_url: str
) -> None:
    from django_redis import get_redis_connection

    from django_idempotency.request import redis_copy
    from tests.request.test_redis_copy import ALIAS, configure

    prefix = configure(settings, redis_url)
    client = get_redis_connection(ALIAS)
    try:
        with pytest.raises(Declined), transaction.atomic():
            charges.charge(key)
            charges.charge(key)  # a replay of the record this transaction wrote
            raise Declined("rolled back")
        scope = f"function:{charges.charge.__module__}.charge"
        assert client.get(redis_copy.redis_key(scope, key)) is None, (
            "an uncommitted record was copied"
        )
        assert_backed(charges.charge(key), key)
        assert charges.runs[key] == 2
    finally:
        for name in client.scan_iter(f"{prefix}:*"):
            client.delete(name)


def test_a_worker_that_catches_a_database_error_and_answers_409_releases_its_key(
    key: str,
) -> None:
    assert _hand_off(key, "integrity_once").status_code == 202
    assert _deliver_latest() == "released"  # not TransactionManagementError, not ACCEPTED
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert charged(key) == 0
