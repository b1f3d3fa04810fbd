"""``@idempotent_webhook`` against the real database: each event handled once, through the inbox.

Deliveries are signed by each provider's own code where a package has it (``stripe``'s
``generate_signature_header``, ``standardwebhooks``' ``Webhook.sign``, and this app's webhook
publisher), and by GitHub's documented scheme for GitHub. Counting widgets counts handler runs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import stripe
from asgiref.sync import async_to_sync
from django.db import connection, connections
from django.test import AsyncClient, Client
from standardwebhooks import Webhook

from django_idempotency.models import FailedMessage, IdempotencyRecord, ProcessedMessage
from django_idempotency.publishers import OutboxMessage
from django_idempotency.publishers.webhook import WebhookPublisher
from tests.testapp import webhooks
from tests.testapp.models import Widget

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.support.webhook_urls"),
]

PROBLEM = "application/problem+json"


@pytest.fixture(autouse=True)
def _fresh_behaviour() -> Iterator[None]:
    webhooks.behaviour.clear()
    webhooks.inside.clear()
    webhooks.release.clear()
    yield
    webhooks.release.set()
    webhooks.behaviour.clear()


def stripe_event(event_id: str = "evt_1PaYmentSucceeded", kind: str = "payment_intent.succeeded"):
    return json.dumps(
        {"id": event_id, "object": "event", "type": kind, "data": {"object": {"id": "pi_1"}}}
    )


def stripe_post(
    client: Client, payload: str, *, timestamp: int | None = None, secret: str | None = None
) -> Any:
    header = stripe.WebhookSignature.generate_signature_header(
        payload, secret or webhooks.STRIPE_SECRET, timestamp=timestamp
    )
    return client.post(
        "/hooks/stripe/",
        data=payload,
        content_type="application/json",
        headers={"Stripe-Signature": header},
    )


def github_headers(body: bytes, delivery: str, *, secret: str = webhooks.GITHUB_SECRET):
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-Hub-Signature-256": f"sha256={digest}",
        "X-GitHub-Delivery": delivery,
        "X-GitHub-Event": "push",
    }


def standard_headers(body: bytes, msg_id: str, *, timestamp: int | None = None):
    at = int(time.time()) if timestamp is None else timestamp
    signature = Webhook(webhooks.STANDARD_SECRET).sign(
        msg_id, datetime.fromtimestamp(at, tz=UTC), body.decode()
    )
    return {"webhook-id": msg_id, "webhook-timestamp": str(at), "webhook-signature": signature}


def nothing_stored() -> bool:
    return (
        not Widget.objects.exists()
        and not ProcessedMessage.objects.exists()
        and not FailedMessage.objects.exists()
    )


# --- exactly once ---------------------------------------------------------------------------------


def test_a_stripe_event_is_handled_once_and_its_redelivery_answered_200_without_running():
    client = Client()
    first = stripe_post(client, stripe_event())
    assert first.status_code == 200 and first.json() == {"handled": "evt_1PaYmentSucceeded"}
    again = stripe_post(client, stripe_event())  # a new signature and timestamp, the same event
    assert again.status_code == 200 and again.json() == {"duplicate": True}
    widget = Widget.objects.get()
    assert widget.name == "stripe:evt_1PaYmentSucceeded"
    assert widget.created_by == "payment_intent.succeeded"
    assert list(ProcessedMessage.objects.values_list("consumer", "message_id")) == [
        ("stripe-payments", "evt_1PaYmentSucceeded")
    ]


def test_each_event_id_is_its_own():
    client = Client()
    for event_id in ("evt_A", "evt_B", "evt_A", "evt_B", "evt_C"):
        assert stripe_post(client, stripe_event(event_id)).status_code == 200
    assert sorted(Widget.objects.values_list("name", flat=True)) == [
        "stripe:evt_A",
        "stripe:evt_B",
        "stripe:evt_C",
    ]


def test_a_github_delivery_is_handled_once_by_its_delivery_id():
    client = Client()
    body = json.dumps({"ref": "refs/heads/main"}).encode()
    delivery = str(uuid.uuid4())
    for _ in range(3):
        response = client.post(
            "/hooks/github/",
            data=body,
            content_type="application/json",
            headers=github_headers(body, delivery),
        )
        assert response.status_code == 200
    widget = Widget.objects.get()
    assert (widget.name, widget.created_by) == (f"github:{delivery}", "push")
    (consumer,) = ProcessedMessage.objects.values_list("consumer", flat=True)
    assert consumer == "webhook:github:tests.testapp.webhooks.github_webhook"


def test_a_standard_webhooks_delivery_is_handled_once_by_its_webhook_id():
    client = Client()
    body = json.dumps({"type": "invoice.paid", "data": {}}).encode()
    for _ in range(2):
        response = client.post(
            "/hooks/standard/",
            data=body,
            content_type="application/json",
            headers=standard_headers(body, "msg_2hVx"),
        )
        assert response.status_code == 200
    widget = Widget.objects.get()
    assert (widget.name, widget.created_by) == ("standard-webhooks:msg_2hVx", "invoice.paid")


def test_a_custom_provider_gets_the_url_arguments_and_its_own_verifier():
    client = Client()
    headers = {"X-Token": webhooks.CUSTOM_TOKEN, "X-Event": "p-1"}
    answers = [
        client.post(
            "/hooks/partner/acme/", data=b"{}", headers=headers, content_type="application/json"
        )
        for _ in range(2)
    ]
    assert [answer.status_code for answer in answers] == [204, 200]
    assert answers[1].json() == {"duplicate": True}
    refused = client.post(
        "/hooks/partner/acme/",
        data=b"{}",
        headers={**headers, "X-Token": "guess", "X-Event": "p-2"},
        content_type="application/json",
    )
    assert refused.status_code == 400 and refused.json()["error"] == "webhook_signature_invalid"
    assert list(Widget.objects.values_list("name", "created_by")) == [("partner:p-1", "acme")]


def async_post(msg_id: str, body: bytes) -> Any:
    """A delivery through Django's ASGI handler (AsyncClient), to the async handler."""
    client = AsyncClient(raise_request_exception=False)
    return async_to_sync(client.post)(
        "/hooks/standard-async/",
        data=body,
        content_type="application/json",
        headers=standard_headers(body, msg_id),
    )


def test_an_async_handler_runs_once():
    body = json.dumps({"type": "user.created"}).encode()
    answers = [async_post("msg_async", body) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [200, 200]
    assert [answer.json() for answer in answers] == [{"handled": "msg_async"}, {"duplicate": True}]
    assert list(Widget.objects.values_list("name", flat=True)) == ["async:msg_async"]
    assert ProcessedMessage.objects.filter(consumer="standard-async").count() == 1


def guarded_by_the_middleware(settings: Any) -> None:
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "MIDDLEWARE_PATHS": [r"^/hooks/"]}


def test_under_the_middleware_a_delivery_needs_no_key_and_is_handled_once(settings):
    guarded_by_the_middleware(settings)
    client = Client()
    answers = [stripe_post(client, stripe_event("evt_mw")) for _ in range(2)]
    body = json.dumps({"type": "user.created"}).encode()
    answers += [async_post("msg_mw_async", body) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [200, 200, 200, 200]
    assert [answer.json() for answer in answers] == [
        {"handled": "evt_mw"},
        {"duplicate": True},
        {"handled": "msg_mw_async"},
        {"duplicate": True},
    ]
    assert sorted(Widget.objects.values_list("name", flat=True)) == [
        "async:msg_mw_async",
        "stripe:evt_mw",
    ]
    assert not IdempotencyRecord.objects.exists()


def test_control_without_the_mark_the_middleware_asks_the_sender_for_a_key(settings, monkeypatch):
    guarded_by_the_middleware(settings)
    monkeypatch.delattr(webhooks.stripe_webhook, "idempotency_exempt")
    answer = stripe_post(Client(), stripe_event("evt_mw_control"))
    assert answer.status_code == 400 and answer["Content-Type"] == PROBLEM
    assert not Widget.objects.exists()


def test_an_async_handler_that_raises_marks_nothing_and_records_the_failure():
    webhooks.behaviour["msg_async_fail"] = "raise"
    assert async_post("msg_async_fail", b"{}").status_code == 500
    assert not Widget.objects.exists() and not ProcessedMessage.objects.exists()
    failure = FailedMessage.objects.get()
    assert (failure.consumer, failure.message_id) == ("standard-async", "msg_async_fail")


def test_our_own_publisher_delivers_to_our_receiver_and_a_resend_runs_nothing(live_server):
    """The relay may send an event twice: the second delivery is a duplicate to the receiver."""
    publisher = WebhookPublisher(
        url=f"{live_server.url}/hooks/standard/", secret=webhooks.STANDARD_SECRET
    )
    sent = OutboxMessage(
        event_id=uuid.uuid4(),
        topic="invoices.paid",
        key="inv-1",
        payload={"amount": 10},
        headers={},
        created_at=datetime(2026, 1, 2, tzinfo=UTC),
    )
    publisher.publish(sent)
    publisher.publish(sent)
    publisher.close()
    (widget,) = Widget.objects.all()
    assert widget.name == f"standard-webhooks:{sent.event_id}"
    assert ProcessedMessage.objects.get().message_id == str(sent.event_id)


# --- refused before anything is stored ------------------------------------------------------------


def test_a_bad_or_missing_signature_is_400_and_stores_nothing():
    client = Client()
    forged = stripe_post(client, stripe_event(), secret="whsec_not_the_endpoints")
    assert forged.status_code == 400 and forged["Content-Type"] == PROBLEM
    assert forged.json()["error"] == "webhook_signature_invalid"
    unsigned = client.post("/hooks/stripe/", data=stripe_event(), content_type="application/json")
    assert unsigned.status_code == 400 and unsigned.json()["error"] == "webhook_signature_invalid"
    body = b'{"ref": "x"}'
    tampered = client.post(
        "/hooks/github/",
        data=body + b" ",
        content_type="application/json",
        headers=github_headers(body, "d-1"),
    )
    assert tampered.status_code == 400
    assert nothing_stored()


def test_a_stale_timestamp_is_400_and_stores_nothing():
    client = Client()
    stale = stripe_post(client, stripe_event(), timestamp=int(time.time()) - 301)
    assert stale.status_code == 400 and stale.json()["error"] == "webhook_timestamp_stale"
    body = b"{}"
    old = client.post(
        "/hooks/standard/",
        data=body,
        content_type="application/json",
        headers=standard_headers(body, "msg_old", timestamp=int(time.time()) - 3600),
    )
    assert old.status_code == 400 and old.json()["error"] == "webhook_timestamp_stale"
    assert nothing_stored()


def test_an_oversized_body_is_413_and_stores_nothing():
    body = json.dumps({"pad": "x" * 5000}).encode()  # the endpoint's max_body is 4096
    response = Client().post(
        "/hooks/standard/",
        data=body,
        content_type="application/json",
        headers=standard_headers(body, "msg_big"),
    )
    assert response.status_code == 413 and response.json()["error"] == "webhook_body_too_large"
    assert nothing_stored()


@pytest.mark.parametrize(
    "payload",
    [
        json.dumps({"object": "event"}),  # no id
        json.dumps({"id": 42}),
        json.dumps({"id": "evt with spaces"}),
        json.dumps({"id": "e" * 256}),
        json.dumps(["evt_1"]),
        "not json",
    ],
)
def test_a_malformed_event_id_is_400_and_stores_nothing(payload):
    response = stripe_post(Client(), payload)
    assert response.status_code == 400 and response.json()["error"] == "webhook_id_invalid"
    assert nothing_stored()


def test_a_github_delivery_without_its_id_is_400():
    body = b"{}"
    headers = github_headers(body, "x")
    del headers["X-GitHub-Delivery"]
    response = Client().post(
        "/hooks/github/", data=body, content_type="application/json", headers=headers
    )
    assert response.status_code == 400 and response.json()["error"] == "webhook_id_invalid"
    assert nothing_stored()


def test_only_post_is_received():
    assert Client().get("/hooks/stripe/").status_code == 405
    assert nothing_stored()


# --- failures: 5xx, nothing marked, recorded in the failure groups --------------------------------


def test_a_handler_that_raises_answers_500_marks_nothing_and_the_retry_runs():
    webhooks.behaviour["evt_fails_once"] = "raise"
    client = Client(raise_request_exception=False)
    failed = stripe_post(client, stripe_event("evt_fails_once"))
    assert failed.status_code == 500
    assert not Widget.objects.exists() and not ProcessedMessage.objects.exists()
    failure = FailedMessage.objects.get()
    assert (failure.consumer, failure.message_id) == ("stripe-payments", "evt_fails_once")
    assert failure.last_error == "RuntimeError: the handler failed on evt_fails_once"
    assert "RuntimeError" in failure.failure_traceback

    del webhooks.behaviour["evt_fails_once"]  # the sender retries; the handler works now
    assert stripe_post(client, stripe_event("evt_fails_once")).status_code == 200
    assert Widget.objects.count() == 1 and ProcessedMessage.objects.count() == 1
    assert not FailedMessage.objects.exists()  # handled at last: its failure record goes


def test_failures_of_different_events_group_by_their_fingerprint():
    client = Client(raise_request_exception=False)
    for event_id in ("evt_G1", "evt_G2", "evt_G2"):
        webhooks.behaviour[event_id] = "raise"
        assert stripe_post(client, stripe_event(event_id)).status_code == 500
    failures = FailedMessage.objects.order_by("message_id")
    assert [(f.message_id, f.attempts) for f in failures] == [("evt_G1", 1), ("evt_G2", 2)]
    assert len({f.failure_fingerprint for f in failures}) == 1


def test_a_handler_answering_503_marks_nothing_and_passes_its_answer_on():
    webhooks.behaviour["evt_503"] = "503"
    response = stripe_post(Client(), stripe_event("evt_503"))
    assert response.status_code == 503 and response.content == b"try later"
    assert not Widget.objects.exists() and not ProcessedMessage.objects.exists()
    assert FailedMessage.objects.get().last_error == "WebhookNotHandled: the handler answered 503"


def test_a_handler_that_rolls_back_answers_500_and_marks_nothing():
    webhooks.behaviour["evt_rb"] = "rollback"
    response = stripe_post(Client(), stripe_event("evt_rb"))
    assert response.status_code == 500 and response.json()["error"] == "webhook_not_handled"
    assert not Widget.objects.exists() and not ProcessedMessage.objects.exists()
    assert "rollback" in FailedMessage.objects.get().last_error


# --- concurrent deliveries ------------------------------------------------------------------


@pytest.mark.concurrency
def test_four_concurrent_deliveries_of_one_event_run_the_handler_once():
    """Four threads, four connections: the first to insert the marker runs the handler (held in
    its transaction); the other three wait on the marker's unique key, then answer duplicate."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer at a time: no concurrent deliveries to race")
    webhooks.behaviour["evt_race"] = "hold"
    payload = stripe_event("evt_race")
    start = threading.Barrier(4)
    answers: list[Any] = []

    def deliver() -> None:
        try:
            start.wait(10)
            answers.append(stripe_post(Client(), payload))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert webhooks.inside.wait(30)  # one handler runs, holding its transaction open
    time.sleep(0.5)  # the other three reach the marker's insert and wait on it
    assert Widget.objects.count() == 0  # nothing committed yet
    webhooks.release.set()
    for thread in threads:
        thread.join(30)
    assert sorted(answer.status_code for answer in answers) == [200, 200, 200, 200]
    bodies = sorted(json.dumps(answer.json()) for answer in answers)
    assert bodies == [json.dumps({"duplicate": True})] * 3 + [json.dumps({"handled": "evt_race"})]
    assert Widget.objects.filter(name="stripe:evt_race").count() == 1
    assert ProcessedMessage.objects.filter(message_id="evt_race").count() == 1
