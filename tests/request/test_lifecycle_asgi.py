"""The lifecycle under a real ASGI server (uvicorn): async views through ``@idempotent`` and the
middleware, and sync views adapted by Django's ASGI handler, each answering replays, 409s,
422s, rollbacks and failures as the WSGI path does."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_idempotency.models import IdempotencyRecord
from tests.support.servers import Server, uvicorn
from tests.testapp import doors
from tests.testapp.models import Widget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.concurrency]

#: Every door; the async ones are the point, the sync ones show Django's adaptation holds too.
DOORS = ["decorator-async", "middleware-async", "decorator", "middleware", "mixin"]


@pytest.fixture(scope="module")
def server(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Server]:
    with django_db_blocker.unblock(), uvicorn() as running:
        yield running


def post(server: Server, door: str, key: str, **body: Any) -> tuple[int, dict[str, str], Any]:
    status, headers, content = server.request(
        "POST", doors.DOORS[door], body, headers={"Idempotency-Key": key}
    )
    try:
        return status, headers, json.loads(content) if content else None
    except ValueError:
        return status, headers, content.decode(errors="replace")


@pytest.mark.parametrize("door", DOORS)
def test_replay_and_mismatch(server, door):
    key = f"asgi-{uuid.uuid4()}"
    status, headers, first = post(server, door, key, name="a")
    assert status == 201, first
    assert headers["Idempotent-Replay"] == "false"
    status, headers, again = post(server, door, key, name="a")
    assert (status, headers["Idempotent-Replay"], again) == (201, "true", first)
    status, _, mismatch = post(server, door, key, name="b")
    assert status == 422 and mismatch["error"] == "payload_mismatch"
    assert Widget.objects.filter(name="a").count() == 1


@pytest.mark.parametrize("door", DOORS)
def test_a_duplicate_in_flight_gets_409_and_the_work_happens_once(server, door, tmp_path: Path):
    key = f"asgi-{uuid.uuid4()}"
    hold = tmp_path / "hold"
    hold.touch()
    results: list[tuple[int, dict[str, str], Any]] = []
    first = threading.Thread(
        target=lambda: results.append(post(server, door, key, name="held", hold_file=str(hold)))
    )
    first.start()
    try:
        deadline = 300
        while not IdempotencyRecord.objects.filter(key=key).exists() and deadline:
            threading.Event().wait(0.1)
            deadline -= 1
        status, headers, body = post(server, door, key, name="held", hold_file=str(hold))
        assert status == 409, body
        assert body["error"] == "transaction_in_progress" and int(headers["Retry-After"]) >= 1
    finally:
        hold.unlink()
        first.join(60)
    assert results[0][0] == 201
    assert Widget.objects.filter(name="held").count() == 1
    status, headers, _ = post(server, door, key, name="held", hold_file=str(hold))
    assert headers["Idempotent-Replay"] == "true"


@pytest.mark.parametrize("mode", ["rollback", "integrity", "raise"])
@pytest.mark.parametrize("door", DOORS)
def test_a_failed_or_rolled_back_view_keeps_nothing_and_a_retry_runs(server, door, mode):
    key = f"asgi-{uuid.uuid4()}"
    name = f"{mode}-{key}"
    status, _, _ = post(server, door, key, name=name, mode=f"{mode}_once")
    assert status == (500 if mode == "raise" else 409)
    assert not Widget.objects.filter(name=name).exists()
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    status, _, body = post(server, door, key, name=name, mode=f"{mode}_once")
    assert status == 201, body
    assert Widget.objects.filter(name=name).count() == 1
