"""Concurrency and crashes with real threads and real server processes on the real database."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter

import pytest
from django.db import connection
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.support.servers import gunicorn
from tests.testapp.models import Widget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.concurrency]

THREADS = 32


def hammer(bodies: list[dict], key: str) -> list:
    """Send one request per body, all released at the same instant from their own threads."""
    barrier = threading.Barrier(len(bodies))
    responses: list = [None] * len(bodies)

    def send(index: int) -> None:
        client = APIClient()
        try:
            barrier.wait(30)
            responses[index] = client.post(
                "/api/widget/", bodies[index], format="json", HTTP_IDEMPOTENCY_KEY=key
            )
        finally:
            connection.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(response is not None for response in responses)
    return responses


def test_same_key_and_body_from_32_threads_runs_once(key):
    responses = hammer([{"name": "w", "sleep": 0.3}] * THREADS, key)
    statuses = Counter(response.status_code for response in responses)
    assert Widget.objects.count() == 1
    assert set(statuses) <= {201, 409}, statuses
    originals = [r for r in responses if r.status_code == 201 and r["Idempotent-Replay"] == "false"]
    assert len(originals) == 1
    for response in responses:
        if response.status_code == 201:
            assert response.content == originals[0].content
        else:
            assert json.loads(response.content)["error"] == "transaction_in_progress"
            assert int(response["Retry-After"]) >= 1


def test_same_key_with_different_bodies_runs_one_of_them(key):
    bodies = [{"name": f"w{i}", "sleep": 0.3} for i in range(THREADS)]
    responses = hammer(bodies, key)
    assert Widget.objects.count() == 1
    winner = Widget.objects.get().name
    for body, response in zip(bodies, responses, strict=True):
        if response.status_code == 201:
            assert body["name"] == winner
        else:
            error = json.loads(response.content)["error"]
            assert (response.status_code, error) in {
                (409, "transaction_in_progress"),
                (422, "payload_mismatch"),
            }


#: The project loaded once in gunicorn's master: the worker forked to replace a killed one
#: answers at once. Without it, beside CI's other passes, the replacement took over 30 s to
#: import the project, and the retry meant to land inside the lease timed out instead.
PRELOAD = "--preload"


def _kill_mid_view(server, key: str, body: dict) -> float:
    """Start a request that holds inside its view, SIGKILL its worker, and return when."""
    worker = server.worker_pids()[0]
    doomed = threading.Thread(
        target=lambda: _swallow(
            server.request, "POST", "/api/widget/", body, {"Idempotency-Key": key},
        ),
        daemon=True,
    )  # fmt: skip
    doomed.start()
    _wait_for(lambda: IdempotencyRecord.objects.filter(key=key).exists())
    os.kill(worker, signal.SIGKILL)  # dies mid-view, inside its business transaction
    return time.monotonic()


def test_killed_server_process_leaves_a_key_that_recovers_after_its_lease(key, tmp_path):
    """Without owner locks (SQLite, or TAKE_OVER_DEAD_OWNERS off) the lease decides."""
    lease_seconds = 6
    hold = tmp_path / "hold"
    hold.touch()
    body = {"name": "w", "hold_file": str(hold)}
    settings = {
        "IDEMPOTENCY_TEST_LEASE_SECONDS": str(lease_seconds),
        "IDEMPOTENCY_TEST_TAKE_OVER_DEAD_OWNERS": "false",
        "GUNICORN_CMD_ARGS": PRELOAD,
    }
    with gunicorn(**settings) as server:
        _kill_mid_view(server, key, body)
        status, headers, content = server.request(
            "POST", "/api/widget/", body, {"Idempotency-Key": key}
        )
        assert status == 409, content
        assert json.loads(content)["error"] == "transaction_in_progress"
        assert 1 <= int(headers["Retry-After"]) <= lease_seconds
        hold.unlink()  # from now on the view runs straight through
        # Retry as a client would, honouring Retry-After, until the key is taken over.
        deadline = time.monotonic() + 60
        while status == 409 and time.monotonic() < deadline:
            time.sleep(min(int(headers["Retry-After"]), 2))
            status, headers, content = server.request(
                "POST", "/api/widget/", body, {"Idempotency-Key": key}
            )
        assert status == 201, content
        assert json.loads(content)["attempt"] == 2
    assert Widget.objects.count() == 1
    record = IdempotencyRecord.objects.get(key=key)
    assert (record.status, record.attempts) == ("COMPLETED", 2)


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite has no session locks")
def test_a_killed_owner_is_taken_over_at_once_not_after_its_lease(key, tmp_path):
    """The owner's connection dies with its process, and its session lock with it: the next
    retry finds the lock free and takes the key over, long before the 30 s lease ends."""
    hold = tmp_path / "hold"
    hold.touch()
    body = {"name": "w", "hold_file": str(hold)}
    with gunicorn(IDEMPOTENCY_TEST_LEASE_SECONDS="30", GUNICORN_CMD_ARGS=PRELOAD) as server:
        killed_at = _kill_mid_view(server, key, body)
        hold.unlink()
        status, statuses = 409, []
        while status == 409 and time.monotonic() - killed_at < 25:
            status, headers, content = server.request(
                "POST", "/api/widget/", body, {"Idempotency-Key": key}
            )
            statuses.append(status)
            if status == 409:
                time.sleep(0.1)
        recovered_after = time.monotonic() - killed_at
        assert status == 201, content
        assert json.loads(content)["attempt"] == 2
    print(f"\ntaken over {recovered_after:.2f} s after the kill; answers before: {statuses}")
    assert recovered_after < 20, f"the key waited {recovered_after:.1f} s: its lease, not its owner"
    assert Widget.objects.count() == 1
    record = IdempotencyRecord.objects.get(key=key)
    assert (record.status, record.attempts) == ("COMPLETED", 2)


def _swallow(call, *args):
    with contextlib.suppress(OSError):  # the connection dies with the worker
        call(*args)


def _wait_for(condition, deadline: float = 30) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")
