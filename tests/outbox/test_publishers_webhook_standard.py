"""The webhook publisher speaks Standard Webhooks: a receiver built on the ``standardwebhooks``
library verifies our events, over real HTTP; the legacy scheme stays an option."""

from __future__ import annotations

import base64
import json
import re
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory
from standardwebhooks import Webhook, WebhookVerificationError

from django_idempotency.exceptions import BrokerConfigurationError, IdempotencyConfigurationError
from django_idempotency.publishers import OutboxMessage
from django_idempotency.publishers.webhook import (
    WebhookPublisher,
    new_secret,
    standard_key,
    verify_signature,
)

SECRET = new_secret()
DOCS = Path(__file__).resolve().parents[2] / "docs"


def message(**headers: str) -> OutboxMessage:
    return OutboxMessage(
        event_id=uuid.uuid4(),
        topic="orders.paid",
        key="order-1",
        payload={"total": "9.99", "note": "café"},
        headers=headers,
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )


class VerifyingReceiver:
    """A local HTTP server that verifies every request with ``standardwebhooks``' own
    ``Webhook.verify``: 204 when it verifies, 401 when it does not; records both."""

    def __init__(self, secret: str) -> None:
        self.verified: list[tuple[dict[str, str], Any]] = []
        self.refused: list[str] = []
        receiver = self
        webhook = Webhook(secret)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = dict(self.headers)
                try:
                    envelope = webhook.verify(body, headers)
                except (WebhookVerificationError, ValueError) as exc:
                    receiver.refused.append(str(exc))
                    status = 401
                else:
                    receiver.verified.append((headers, envelope))
                    status = 204
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[VerifyingReceiver]:
    server = VerifyingReceiver(SECRET)
    yield server
    server.close()


def test_a_standard_webhooks_receiver_verifies_our_events_over_http(
    receiver: VerifyingReceiver,
) -> None:
    publisher = WebhookPublisher(url=receiver.url, secret=SECRET, timeout=5)
    sent = message(tenant="acme")
    before = int(time.time())
    publisher.publish(sent)
    publisher.close()
    assert receiver.refused == []
    ((headers, envelope),) = receiver.verified
    lower = {name.lower(): value for name, value in headers.items()}
    assert lower["webhook-id"] == str(sent.event_id) == lower["idempotency-key"]
    assert before <= int(lower["webhook-timestamp"]) <= int(time.time())
    assert re.fullmatch(r"v1,[A-Za-z0-9+/]{43}=", lower["webhook-signature"])
    assert envelope["event_id"] == str(sent.event_id)
    assert envelope["payload"] == {"total": "9.99", "note": "café"}
    assert envelope["headers"] == {"tenant": "acme"}


def test_a_receiver_with_another_secret_refuses_and_the_route_is_a_configuration_error() -> None:
    receiver = VerifyingReceiver(new_secret())
    try:
        publisher = WebhookPublisher(url=receiver.url, secret=SECRET, timeout=5)
        (result,) = publisher.publish_many([message()])
        publisher.close()
    finally:
        receiver.close()
    assert isinstance(result, BrokerConfigurationError) and "answered 401" in str(result)
    assert receiver.verified == [] and receiver.refused == ["No matching signature found"]


def test_the_signature_covers_the_id_the_timestamp_and_the_body() -> None:
    publisher = WebhookPublisher(url="http://127.0.0.1:1/", secret=SECRET)
    body = json.dumps({"a": 1}).encode()
    headers = publisher.signature_headers("evt-1", body)
    publisher.close()
    webhook = Webhook(SECRET)
    assert webhook.verify(body, headers, json_parse=False) is None
    for changed in (
        {**headers, "webhook-id": "evt-2"},
        {**headers, "webhook-timestamp": str(int(headers["webhook-timestamp"]) - 1)},
    ):
        with pytest.raises(WebhookVerificationError):
            webhook.verify(body, changed)
    with pytest.raises(WebhookVerificationError):
        webhook.verify(body + b" ", headers)


def test_the_legacy_scheme_is_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = WebhookPublisher(
        url="http://127.0.0.1:1/", secret="plain words", signature_scheme="legacy"
    )
    headers = publisher.signature_headers("evt-1", b"{}")
    publisher.close()
    assert set(headers) == {"Webhook-Signature"}
    assert verify_signature("plain words", b"{}", headers["Webhook-Signature"])
    renamed = WebhookPublisher(
        url="http://127.0.0.1:1/",
        secret="k",
        signature_scheme="legacy",
        signature_header="X-Signature",
    )
    assert set(renamed.signature_headers("evt-1", b"{}")) == {"X-Signature"}
    renamed.close()


@pytest.mark.parametrize(
    "secret",
    [
        "s3cret",  # no prefix: a legacy secret
        "whsec_",  # nothing after the prefix
        "whsec_not base64!",
        "whsec_YWJj=x",  # padding in the middle
    ],
)
def test_a_secret_that_is_not_a_standard_webhooks_secret_is_refused_naming_the_fix(
    secret: str,
) -> None:
    with pytest.raises(IdempotencyConfigurationError) as raised:
        WebhookPublisher(url="http://127.0.0.1:1/", secret=secret)
    text = str(raised.value)
    assert "whsec_" in text and "'signature_scheme': 'legacy'" in text and "new_secret()" in text
    tail = secret.removeprefix("whsec_")
    if tail:
        assert tail not in text  # the message never quotes the secret


def test_secrets_are_read_as_the_library_reads_them() -> None:
    key = b"\x00\xffkey bytes of any kind\x10"
    secret = "whsec_" + base64.b64encode(key).decode()
    assert standard_key(secret) == key == standard_key(key)
    assert len(standard_key(new_secret())) == 32 and new_secret() != new_secret()
    body = b'{"x": 1}'
    publisher = WebhookPublisher(url="http://127.0.0.1:1/", secret=key)
    headers = publisher.signature_headers("evt-1", body)
    publisher.close()
    Webhook(secret).verify(body, headers)  # the library, given the string form of the same key


def test_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(IdempotencyConfigurationError, match="'standard'.*'legacy'"):
        WebhookPublisher(url="http://127.0.0.1:1/", secret=SECRET, signature_scheme="v2")  # type: ignore[arg-type]


# --- the receiver docs/publishers.md shows ---------------------------------------------------


def docs_receiver() -> Callable[[HttpRequest], HttpResponse]:
    """The Standard Webhooks receiver docs/publishers.md shows, as a view: its block, then a 204."""
    page = (DOCS / "publishers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    (snippet,) = [block for block in blocks if "Webhook(SECRET).verify(" in block]
    assert "hmac" not in snippet
    source = (
        "def receive(request):\n"
        + textwrap.indent(snippet, "    ")
        + "    return HttpResponse(status=204)\n"
    )
    namespace: dict[str, Any] = {"HttpResponse": HttpResponse, "SECRET": SECRET}
    exec(compile(source, "docs/publishers.md", "exec"), namespace)  # noqa: S102
    receive: Callable[[HttpRequest], HttpResponse] = namespace["receive"]
    return receive


class CapturingReceiver:
    """A local HTTP server that keeps what it received and answers 204."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), body))
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _as_django_request(headers: dict[str, str], body: bytes) -> HttpRequest:
    forwarded = {name: value for name, value in headers.items() if name.lower() != "content-type"}
    return RequestFactory().post(
        "/hooks/", data=body, content_type="application/json", headers=forwarded
    )


def test_the_documented_receiver_accepts_what_we_sent_and_refuses_a_tampered_copy() -> None:
    capture = CapturingReceiver()
    try:
        publisher = WebhookPublisher(url=capture.url, secret=SECRET, timeout=5)
        publisher.publish(message())
        publisher.close()
    finally:
        capture.close()
    ((headers, body),) = capture.requests
    receive = docs_receiver()
    assert receive(_as_django_request(headers, body)).status_code == 204
    assert receive(_as_django_request(headers, body.replace(b"9.99", b"0.01"))).status_code == 401
    malformed = {**headers, "webhook-signature": "v1"}  # the library raises ValueError on it
    assert receive(_as_django_request(malformed, body)).status_code == 401
    stale = {**headers, "webhook-timestamp": str(int(time.time()) - 3600)}
    assert receive(_as_django_request(stale, body)).status_code == 401
