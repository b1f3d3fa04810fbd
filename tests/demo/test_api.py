"""The demo's API through a real gunicorn server: every answer the quick start promises."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

import pytest

from demo_project.payments.management.commands.idempotency_tour import Answer
from tests.demo.conftest import LEASE_SECONDS, DemoServer

PROBLEM = "application/problem+json"


def new_key() -> str:
    return f"test-{uuid.uuid4()}"


def pay(
    server: DemoServer,
    key: str | None,
    amount: str = "25.00",
    *,
    headers: dict[str, str] | None = None,
    user: str | None = None,
    password: str = "",
) -> Answer:
    """A payment between acc_3 and acc_4, which the tour (acc_1 to acc_2) leaves alone."""
    client = server.client(user, password)
    return client.pay(key, amount, source="acc_3", destination="acc_4", headers=headers)


def moved(before: dict[str, Decimal], after: dict[str, Decimal]) -> Decimal:
    """How much went from acc_3 to acc_4, checking nothing was created or lost on the way."""
    assert after["acc_3"] + after["acc_4"] == before["acc_3"] + before["acc_4"]
    return before["acc_3"] - after["acc_3"]


def test_a_payment_answers_201_and_moves_the_money(demo_server: DemoServer) -> None:
    before = demo_server.balances()
    answer = pay(demo_server, new_key(), "25.00")
    assert answer.status == 201, answer.body
    assert answer.headers["idempotent-replay"] == "false"
    assert answer.body["status"] == "completed"
    assert answer.body["amount"] == "25.00"
    assert uuid.UUID(answer.body["transaction_id"])
    assert answer.body["processed_at"]
    assert moved(before, demo_server.balances()) == Decimal("25.00")


def test_a_retry_is_replayed_and_moves_nothing(demo_server: DemoServer) -> None:
    key = new_key()
    before = demo_server.balances()
    first = pay(demo_server, key, "12.50")
    retries = [pay(demo_server, key, "12.50") for _ in range(3)]
    assert first.status == 201
    for retry in retries:
        assert retry.status == 201
        assert retry.headers["idempotent-replay"] == "true"
        assert retry.body == first.body
    assert moved(before, demo_server.balances()) == Decimal("12.50")


@pytest.mark.concurrency
def test_a_concurrent_double_submit_is_answered_409(demo_server: DemoServer) -> None:
    key = new_key()
    before = demo_server.balances()
    # Both hold their payment open for a while; whichever claims the key first runs.
    slow = {"X-Demo-Fault": f"slow={LEASE_SECONDS / 2:g}"}
    answers: list[Answer] = []
    first = threading.Thread(target=lambda: answers.append(pay(demo_server, key, headers=slow)))
    first.start()
    time.sleep(0.5)
    answers.append(pay(demo_server, key, headers=slow))
    first.join()
    assert sorted(answer.status or 0 for answer in answers) == [201, 409]
    conflict = next(answer for answer in answers if answer.status == 409)
    assert conflict.headers["content-type"] == PROBLEM
    assert conflict.body["error"] == "transaction_in_progress"
    assert 1 <= int(conflict.headers["retry-after"]) <= LEASE_SECONDS
    assert moved(before, demo_server.balances()) == Decimal("25.00")


def test_a_reused_key_with_another_body_is_answered_422(demo_server: DemoServer) -> None:
    key = new_key()
    assert pay(demo_server, key, "5.00").status == 201
    before = demo_server.balances()
    answer = pay(demo_server, key, "6.00")
    assert answer.status == 422
    assert answer.headers["content-type"] == PROBLEM
    assert answer.body["error"] == "payload_mismatch"
    assert answer.body["status"] == 422
    assert moved(before, demo_server.balances()) == Decimal("0.00")


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({}, "idempotency_key_missing"),
        ({"Idempotency-Key": ""}, "idempotency_key_invalid"),
        ({"Idempotency-Key": "x" * 256}, "idempotency_key_invalid"),
        ({"Idempotency-Key": "caf\u00e9"}, "idempotency_key_invalid"),
    ],
)
def test_a_missing_or_malformed_key_is_answered_400(
    demo_server: DemoServer, headers: dict[str, str], error: str
) -> None:
    before = demo_server.balances()
    answer = pay(demo_server, None, headers=headers)
    assert answer.status == 400
    assert answer.headers["content-type"] == PROBLEM
    assert answer.body["error"] == error
    assert moved(before, demo_server.balances()) == Decimal("0.00")


def test_a_refund_is_applied_once(demo_server: DemoServer) -> None:
    before = demo_server.balances()
    payment = pay(demo_server, new_key(), "40.00").body
    path = f"/api/v1/payments/{payment['transaction_id']}/"
    key = new_key()
    client = demo_server.client()
    first = client.request("PATCH", path, {"status": "refunded"}, {"Idempotency-Key": key})
    retry = client.request("PATCH", path, {"status": "refunded"}, {"Idempotency-Key": key})
    assert first.status == 200, first.body
    assert first.body["status"] == "refunded"
    assert retry.status == 200
    assert retry.headers["idempotent-replay"] == "true"
    assert moved(before, demo_server.balances()) == Decimal("0.00")
    # A second refund is a new request (new key): the payment says no.
    again = client.request("PATCH", path, {"status": "refunded"}, {"Idempotency-Key": new_key()})
    assert again.status == 400
    assert moved(before, demo_server.balances()) == Decimal("0.00")


def raw_request(
    server: DemoServer, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], Any]:
    """A request with exactly these bytes and headers (the tour's client only sends JSON)."""
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.netloc, timeout=60)
    try:
        connection.request(
            method, path, body=body, headers={"Accept": "application/json", **headers}
        )
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    headers = {k.lower(): v for k, v in response.getheaders()}
    try:
        return response.status, headers, json.loads(raw)
    except ValueError:
        return response.status, headers, raw.decode(errors="replace")


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", b"{}"),
        ("multipart/form-data; boundary=nothing-here", b""),
        ("multipart/form-data; boundary=nothing-here", b"--nothing-here--\r\n"),
    ],
    ids=["json", "empty-multipart", "multipart-without-parts"],
)
def test_a_status_change_without_a_status_is_a_400_field_error(
    demo_server: DemoServer, content_type: str, body: bytes
) -> None:
    payment = pay(demo_server, new_key(), "3.00").body
    path = f"/api/v1/payments/{payment['transaction_id']}/"
    key = new_key()
    headers = {"Content-Type": content_type, "Idempotency-Key": key}
    status, answer_headers, answer = raw_request(demo_server, "PATCH", path, body, headers)
    assert status == 400, answer
    assert answer_headers["content-type"] == "application/json"
    assert answer == {"status": ["This field is required."]}
    # A refusal before anything changed: the payment is as it was, and the key is free.
    assert demo_server.client().request("GET", path).body["status"] == "completed"
    fixed = demo_server.client().request(
        "PATCH", path, {"status": "disputed"}, {"Idempotency-Key": key}
    )
    assert fixed.status == 200, fixed.body
    assert fixed.body["status"] == "disputed"


def test_anonymous_clients_and_the_demo_user_have_their_own_scopes(
    demo_server: DemoServer,
) -> None:
    key = new_key()
    before = demo_server.balances()
    anonymous = pay(demo_server, key, "1.00")
    demo_user = pay(demo_server, key, "1.00", user="demo", password="demo-password")
    assert anonymous.status == demo_user.status == 201
    assert demo_user.headers["idempotent-replay"] == "false"
    assert anonymous.body["transaction_id"] != demo_user.body["transaction_id"]
    assert moved(before, demo_server.balances()) == Decimal("2.00")
    wrong_password = pay(demo_server, new_key(), "1.00", user="demo", password="wrong")
    assert wrong_password.status == 401
    assert moved(before, demo_server.balances()) == Decimal("2.00")


def test_insufficient_funds_are_refused_and_the_key_stays_free(demo_server: DemoServer) -> None:
    key = new_key()
    before = demo_server.balances()
    refused = pay(demo_server, key, "999999.00")
    assert refused.status == 400
    assert "insufficient funds" in str(refused.body["amount"])
    # Not stored: the same request runs again instead of replaying the refusal.
    again = pay(demo_server, key, "999999.00")
    assert again.status == 400
    assert again.headers.get("idempotent-replay") != "true"
    assert moved(before, demo_server.balances()) == Decimal("0.00")


def test_a_malformed_fault_header_is_a_400_that_leaves_the_key_free(
    demo_server: DemoServer,
) -> None:
    key = new_key()
    refused = pay(demo_server, key, headers={"X-Demo-Fault": "explode"})
    assert refused.status == 400
    assert "X-Demo-Fault" in refused.body
    assert pay(demo_server, key).status == 201


def test_the_schema_documents_the_key_and_the_answers(demo_server: DemoServer) -> None:
    answer = demo_server.client().request("GET", "/api/schema/?format=json")
    assert answer.status == 200
    schema: dict[str, Any] = answer.body
    payments = schema["paths"]["/api/v1/payments/"]
    detail = schema["paths"]["/api/v1/payments/{transaction_id}/"]
    for operation in (payments["post"], detail["patch"]):
        key = next(p for p in operation["parameters"] if p["name"] == "Idempotency-Key")
        assert key["in"] == "header"
        assert key["required"] is True
        for status in ("400", "409", "422"):
            assert PROBLEM in operation["responses"][status]["content"]
        assert "Retry-After" in operation["responses"]["409"]["headers"]
    assert all(p["name"] != "Idempotency-Key" for p in payments["get"].get("parameters", []))
    swagger = demo_server.client().request("GET", "/api/docs/", headers={"Accept": "text/html"})
    assert swagger.status == 200
    assert "swagger-ui" in swagger.body
