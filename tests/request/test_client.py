"""``django_idempotency.client``: one key per operation, retried on the right answers only.

The retry policy is tested against ``httpx.MockTransport`` (answers scripted per attempt, waits
recorded by a fake sleep, never timed); the protocol against the live test server.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest
from django.db import connection

from django_idempotency import client as client_module
from django_idempotency.client import (
    AsyncIdempotentClient,
    IdempotentClient,
    PayloadMismatchError,
    RetryPolicy,
    retry_after,
)
from django_idempotency.conf import DEFAULTS
from tests.testapp.models import Widget

Answer = httpx.Response | Exception


class Script:
    """A MockTransport handler answering each attempt from a list; records what was sent."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @property
    def keys(self) -> list[str | None]:
        return [request.headers.get("Idempotency-Key") for request in self.requests]


def problem(status: int, error: str, **headers: str) -> httpx.Response:
    return httpx.Response(
        status,
        json={"error": error},
        headers={"Content-Type": "application/problem+json", **headers},
    )


def created(**headers: str) -> httpx.Response:
    return httpx.Response(201, json={"id": 1}, headers={"Idempotent-Replay": "false", **headers})


def scripted(
    script: Script, waits: list[float], policy: RetryPolicy | None = None, **options: Any
) -> IdempotentClient:
    return IdempotentClient(
        "http://api.test",
        transport=httpx.MockTransport(script),
        policy=policy,
        sleep=waits.append,
        uniform=lambda low, high: high,  # the top of each jitter range: deterministic
        **options,
    )


def test_the_header_names_are_the_servers_defaults() -> None:
    assert DEFAULTS["HEADER"] == client_module.DEFAULT_HEADER
    assert DEFAULTS["REPLAY_HEADER"] == client_module.DEFAULT_REPLAY_HEADER


def test_one_key_per_operation_reused_for_every_retry() -> None:
    script = Script(
        httpx.ConnectError("refused"),
        problem(503, "idempotency_store_unavailable"),
        created(),
        created(),
    )
    waits: list[float] = []
    client = scripted(script, waits)
    first = client.post("/payments/", json={"amount": "1.00"})
    assert first.status_code == 201
    assert len(script.keys) == 3 and len(set(script.keys)) == 1 and script.keys[0]
    assert first.request.headers["Idempotency-Key"] == script.keys[0]
    # Identical bodies on every attempt: the server's fingerprint matches.
    assert len({request.content for request in script.requests}) == 1
    client.post("/payments/", json={"amount": "1.00"})
    assert script.keys[3] != script.keys[0]  # a new operation, a new key
    # Full jitter: up to base * 2**(n-1) before retry n.
    assert waits == [0.25, 0.5]


def test_a_given_key_is_used_as_is() -> None:
    script = Script(httpx.ReadTimeout("slow"), created())
    client = scripted(script, [])
    client.patch("/payments/1/", key="refund-1", json={})
    assert script.keys == ["refund-1", "refund-1"]


def test_retry_after_is_honoured_in_seconds_or_as_a_date_and_capped() -> None:
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    script = Script(
        problem(409, "transaction_in_progress", **{"Retry-After": "3"}),
        problem(503, "idempotency_store_unavailable", **{"Retry-After": later}),
        problem(429, "throttled", **{"Retry-After": "not a number"}),
        created(),
    )
    waits: list[float] = []
    client = scripted(script, waits, RetryPolicy(max_retry_after=60, deadline=None))
    assert client.post("/payments/", json={}).status_code == 201
    assert waits[0] == 3
    assert waits[1] == 60  # two minutes asked, capped
    assert waits[2] == 1.0  # unreadable: the third retry's backoff (0.25 * 2**2)


def test_retry_after_parsing() -> None:
    def answer(value: str) -> httpx.Response:
        return httpx.Response(409, headers={"Retry-After": value})

    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert retry_after(answer("7"), now) == 7
    assert retry_after(answer("Thu, 01 Jan 2026 00:00:10 GMT"), now) == 10
    assert retry_after(answer("Wed, 31 Dec 2025 23:00:00 GMT"), now) == 0  # in the past
    assert retry_after(answer("-1"), now) is None
    assert retry_after(answer("soon"), now) is None
    assert retry_after(httpx.Response(409), now) is None


def test_prefer_wait_is_sent_and_configurable() -> None:
    script = Script(created(), created(), created())
    scripted(script, []).post("/x", json={})
    assert script.requests[0].headers["Prefer"] == "wait=5"
    scripted(script, [], RetryPolicy(prefer_wait=20)).post("/x", json={})
    assert script.requests[1].headers["Prefer"] == "wait=20"
    scripted(script, [], RetryPolicy(prefer_wait=None)).post("/x", json={})
    assert "Prefer" not in script.requests[2].headers


def test_the_header_names_are_configurable() -> None:
    script = Script(httpx.Response(409, headers={"X-Replayed": "false"}))
    client = scripted(script, [], header="X-Request-Key", replay_header="X-Replayed")
    # The view's own 409 (marked by the configured replay header) is final.
    assert client.post("/x", json={}).status_code == 409
    assert script.requests[0].headers["X-Request-Key"]
    assert "Idempotency-Key" not in script.requests[0].headers


def test_payload_mismatch_raises() -> None:
    script = Script(problem(422, "payload_mismatch"))
    client = scripted(script, [])
    with pytest.raises(PayloadMismatchError, match="already used for a different request") as e:
        client.post("/payments/", key="k", json={"amount": "2.00"})
    assert e.value.key == "k" and e.value.response.status_code == 422
    assert len(script.requests) == 1


def test_a_views_own_422_and_other_4xx_are_returned_as_they_are() -> None:
    script = Script(
        httpx.Response(422, json={}, headers={"Idempotent-Replay": "false"}),
        problem(400, "idempotency_key_invalid"),
        httpx.Response(404),
    )
    client = scripted(script, [])
    assert client.post("/x", json={}).status_code == 422
    assert client.post("/x", json={}).status_code == 400
    assert client.post("/x", json={}).status_code == 404
    assert len(script.requests) == 3


def test_a_replayed_answer_is_final_whatever_its_status() -> None:
    script = Script(
        httpx.Response(503, headers={"Idempotent-Replay": "true"}),
        httpx.Response(409, headers={"Idempotent-Replay": "true"}),
    )
    client = scripted(script, [])
    assert client.post("/x", json={}).status_code == 503
    assert client.post("/x", json={}).status_code == 409
    assert len(script.requests) == 2


@pytest.mark.parametrize("status", [500, 502, 503, 504, 409, 429])
def test_the_retried_statuses(status: int) -> None:
    script = Script(httpx.Response(status), created())
    assert scripted(script, []).post("/x", json={}).status_code == 201


def test_not_retried_501() -> None:
    script = Script(httpx.Response(501))
    assert scripted(script, []).post("/x", json={}).status_code == 501


def test_attempts_run_out_the_last_response_is_returned_or_the_last_error_raised() -> None:
    script = Script(*[httpx.Response(503)] * 3)
    waits: list[float] = []
    client = scripted(script, waits, RetryPolicy(max_attempts=3))
    assert client.post("/x", json={}).status_code == 503
    assert len(script.requests) == 3 and len(waits) == 2
    script = Script(*[httpx.ConnectError("down")] * 2)
    with pytest.raises(httpx.ConnectError):
        scripted(script, [], RetryPolicy(max_attempts=2)).post("/x", json={})
    assert len(script.requests) == 2


def test_the_deadline_stops_retries_that_would_pass_it() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    script = Script(*[problem(409, "transaction_in_progress", **{"Retry-After": "4"})] * 5)
    client = IdempotentClient(
        "http://api.test",
        transport=httpx.MockTransport(script),
        policy=RetryPolicy(deadline=10, max_attempts=10),
        sleep=sleep,
        clock=lambda: now[0],
    )
    assert client.post("/x", json={}).status_code == 409
    assert len(script.requests) == 3  # waited 4 + 4; a third wait would end at 12 > 10
    assert now[0] == 8


def test_reads_get_no_key_and_are_retried_too() -> None:
    script = Script(httpx.ReadError("reset"), httpx.Response(200))
    assert scripted(script, []).get("/x").status_code == 200
    assert script.keys == [None, None]


def test_async_client_follows_the_same_rules() -> None:
    script = Script(
        httpx.ConnectError("refused"),
        problem(409, "transaction_in_progress", **{"Retry-After": "2"}),
        created(),
        problem(422, "payload_mismatch"),
    )
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def run() -> None:
        async with AsyncIdempotentClient(
            "http://api.test",
            transport=httpx.MockTransport(script),
            sleep=sleep,
            uniform=lambda low, high: high,
        ) as client:
            assert (await client.post("/x", json={"a": 1})).status_code == 201
            with pytest.raises(PayloadMismatchError):
                await client.post("/x", key=script.keys[0], json={"a": 2})

    asyncio.run(run())
    assert waits == [0.25, 2]
    assert len(set(script.keys)) == 1


# --- against the live test server --------------------------------------------------------------


class LoseFirstAnswer(httpx.BaseTransport):
    """Sends every request; drops the connection before the first answer is read (the request
    ran, the client never heard): the case keys exist for."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        response = self.inner.handle_request(request)
        if len(self.sent) == 1:
            response.read()
            response.close()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def live(live_server: Any) -> Iterator[Callable[..., IdempotentClient]]:
    made: list[IdempotentClient] = []

    def make(**options: Any) -> IdempotentClient:
        options.setdefault("uniform", lambda low, high: 0.0)
        options.setdefault("sleep", lambda seconds: None)
        made.append(IdempotentClient(live_server.url, **options))
        return made[-1]

    yield make
    for client in made:
        client.close()


@pytest.mark.django_db(transaction=True)
def test_live_a_lost_answer_is_retried_with_the_same_key_and_replayed(live) -> None:
    transport = LoseFirstAnswer()
    client = live(transport=transport)
    response = client.post("/api/widget/", json={"name": "lost-answer"})
    assert response.status_code == 201
    assert response.headers["Idempotent-Replay"] == "true"  # it had run: this is its answer
    keys = {request.headers["Idempotency-Key"] for request in transport.sent}
    assert len(transport.sent) == 2 and len(keys) == 1
    assert Widget.objects.filter(name="lost-answer").count() == 1


def first_request(live_server: Any, key: str, answers: list[httpx.Response]) -> threading.Thread:
    """The first request for ``key``, by a plain client, in a thread of its own (started)."""

    def post() -> None:
        try:
            with httpx.Client(base_url=live_server.url, timeout=60) as plain:
                headers = {"Idempotency-Key": key}
                answers.append(plain.post("/api/widget/", json={"name": "busy"}, headers=headers))
        finally:
            connection.close()

    thread = threading.Thread(target=post)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_live_a_409_is_retried_after_its_retry_after(live, live_server, gate) -> None:
    started, release = gate("busy")
    first_answer: list[httpx.Response] = []
    key = "live-409"
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        """Record the wait; let the first request finish instead of waiting for real."""
        waits.append(seconds)
        release.set()
        thread.join(60)

    # Not asking to wait: the server would hold the retry (attach) instead of answering 409.
    client = live(sleep=sleep, policy=RetryPolicy(prefer_wait=None))
    thread = first_request(live_server, key, first_answer)
    assert started.wait(30)
    response = client.post("/api/widget/", key=key, json={"name": "busy"})
    assert len(waits) == 1 and waits[0] >= 1  # the 409's Retry-After (seconds left on the lease)
    assert response.status_code == 201
    assert response.headers["Idempotent-Replay"] == "true"
    assert response.content == first_answer[0].content
    assert Widget.objects.filter(name="busy").count() == 1


@pytest.mark.django_db(transaction=True)
def test_live_a_retry_that_asks_to_wait_attaches_to_the_first_request(
    live, live_server, gate
) -> None:
    """The client's ``Prefer: wait``: the server holds the retry until the first request has
    answered, and the retry gets that answer, with no 409 and no sleep on the client."""
    started, release = gate("busy")
    first_answer: list[httpx.Response] = []
    waits: list[float] = []
    client = live(sleep=waits.append)
    thread = first_request(live_server, "live-attach", first_answer)
    assert started.wait(30)
    threading.Timer(0.3, release.set).start()
    response = client.post("/api/widget/", key="live-attach", json={"name": "busy"})
    thread.join(60)
    assert waits == []
    assert response.status_code == 201
    assert response.headers["Idempotent-Replay"] == "true"
    assert response.content == first_answer[0].content
    assert Widget.objects.filter(name="busy").count() == 1


@pytest.mark.django_db(transaction=True)
def test_live_a_reused_key_with_another_body_raises(live) -> None:
    client = live()
    assert client.post("/api/widget/", key="live-422", json={"name": "a"}).status_code == 201
    with pytest.raises(PayloadMismatchError):
        client.post("/api/widget/", key="live-422", json={"name": "b"})


@pytest.mark.django_db(transaction=True)
def test_live_async_client(live_server: Any) -> None:
    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with AsyncIdempotentClient(live_server.url) as client:
            first = await client.post("/api/widget/", key="live-async", json={"name": "async"})
            again = await client.post("/api/widget/", key="live-async", json={"name": "async"})
            return first, again

    first, again = asyncio.run(run())
    assert first.status_code == again.status_code == 201
    assert again.headers["Idempotent-Replay"] == "true"
    assert json.loads(again.content) == json.loads(first.content)
    assert Widget.objects.filter(name="async").count() == 1
