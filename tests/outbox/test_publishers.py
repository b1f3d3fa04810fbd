import base64
import contextlib
import json
import logging
import re
import socket
import threading
import traceback
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone
from kombu import Connection, Exchange, Queue

from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    IdempotencyConfigurationError,
    PublishError,
    UnroutableTopic,
)
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers import OutboxMessage, Publisher, PublisherSet, resolve_route
from django_idempotency.publishers.amqp import AMQPPublisher, Confirms
from django_idempotency.publishers.celery import CeleryPublisher
from django_idempotency.publishers.log import LoggingPublisher
from django_idempotency.publishers.memory import MemoryPublisher
from django_idempotency.publishers.webhook import (
    WebhookPublisher,
    redact_url,
    sign,
    verify_signature,
)
from tests.support.outbox_support import CeilingRandom, publish_committed, settings_with
from tests.support.proxy import tcp_proxy

#: A Standard Webhooks secret, as the webhook publisher signs with by default.
SECRET = "whsec_" + base64.b64encode(b"a test signing key, 32 bytes!!!").decode()

#: A W3C traceparent as ``publish()`` stores it from the request's span.
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def message(topic="orders.paid", payload=None, key="order-1", traceparent=None, **headers):
    return OutboxMessage(
        event_id=uuid.uuid4(),
        topic=topic,
        key=key,
        payload={"total": "9.99"} if payload is None else payload,
        headers=headers,
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        traceparent=traceparent,
    )


# --- routing ----------------------------------------------------------------------------------

MEMORY = "django_idempotency.publishers.memory.MemoryPublisher"
LOGGING = "django_idempotency.publishers.log.LoggingPublisher"


def test_exact_topic_wins_then_the_first_matching_pattern():
    routes = {"*": MEMORY, "orders.*": LOGGING, "orders.paid": {"BACKEND": MEMORY}}
    assert resolve_route("orders.paid", routes).pattern == "orders.paid"
    assert resolve_route("orders.shipped", routes).pattern == "*"
    assert resolve_route("orders.shipped", {"orders.*": LOGGING, "*": MEMORY}).backend == LOGGING
    with pytest.raises(UnroutableTopic, match="OUTBOX_PUBLISHERS"):
        resolve_route("invoices.sent", {"orders.*": LOGGING})


@pytest.mark.parametrize(
    "spec", [42, {"OPTIONS": {}}, {"BACKEND": MEMORY, "OPTIONS": []}, {"BACKEND": MEMORY, "X": 1}]
)
def test_a_malformed_route_names_the_setting(spec):
    with pytest.raises(IdempotencyConfigurationError, match=r"OUTBOX_PUBLISHERS'\]\['\*'\]"):
        resolve_route("a", {"*": spec})


def test_publisher_set_builds_once_per_route_and_explains_bad_backends():
    publishers = PublisherSet()
    with settings_with(OUTBOX_PUBLISHERS={"*": MEMORY}):
        assert publishers.for_topic("a") is publishers.for_topic("b")
    cases = [
        ("django_idempotency.conf.conf", "not a Publisher subclass"),
        ({"BACKEND": MEMORY, "OPTIONS": {"colour": "red"}}, "does not accept"),
        ("no.such.Publisher", "could not be imported"),
    ]
    for spec, error in cases:
        with (
            settings_with(OUTBOX_PUBLISHERS={"*": spec}),
            pytest.raises(IdempotencyConfigurationError, match=error),
        ):
            PublisherSet().for_topic("a")
    publishers.close()


def test_base_publish_many_stops_the_batch_when_the_broker_is_unavailable():
    class Flaky(Publisher):
        calls = 0

        def publish(self, message):
            Flaky.calls += 1
            if message.payload == "bad":
                raise PublishError("this one")
            if message.payload == "down":
                raise BrokerUnavailable("all of them")

    batch = [message(payload=p) for p in ("ok", "bad", "ok", "down", "ok", "ok")]
    results = Flaky().publish_many(batch)
    assert [type(r).__name__ if r else None for r in results] == [
        None,
        "PublishError",
        None,
        "BrokerUnavailable",
        "BrokerUnavailable",
        "BrokerUnavailable",
    ]
    assert Flaky.calls == 4
    with pytest.raises(NotImplementedError):
        Publisher().publish(batch[0])
    with pytest.raises(TypeError, match="takes no options"):
        MemoryPublisher(colour="red")


def test_logging_publisher_logs_the_event(caplog):
    sent = message(traceparent=TRACEPARENT)
    with caplog.at_level(logging.INFO, logger="django_idempotency.publishers.log"):
        LoggingPublisher(level="WARNING").publish(sent)
    record = caplog.records[-1]
    assert record.levelno == logging.WARNING
    assert record.outbox_event_id == str(sent.event_id) and record.outbox_topic == "orders.paid"
    assert record.outbox_traceparent == TRACEPARENT


# --- Celery -----------------------------------------------------------------------------------


def test_celery_publisher_sends_the_task_with_the_event_id_as_task_id():
    from celery import Celery

    app = Celery("publisher-test", set_as_current=False, broker="memory://")
    queue = f"q-{uuid.uuid4().hex}"
    publisher = CeleryPublisher(app=app, task="tests.testapp.tasks.record_effect", queue=queue)
    sent = message(payload={"name": "celery"}, traceparent=TRACEPARENT, tenant="acme")
    publisher.publish(sent)
    other = message(payload=["positional"])
    CeleryPublisher(app=app, queue=queue).publish(other)
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue)
        first, second = simple.get(timeout=5), simple.get(timeout=5)
        simple.close()
    assert first.headers["id"] == str(sent.event_id)
    assert first.headers["task"] == "tests.testapp.tasks.record_effect"
    assert first.headers["event_id"] == str(sent.event_id)
    assert first.headers["event_key"] == "order-1" and first.headers["tenant"] == "acme"
    assert first.headers["traceparent"] == TRACEPARENT
    assert "traceparent" not in second.headers  # published outside any trace
    args, kwargs, _ = first.payload
    assert (args, kwargs) == ([], {"name": "celery"})
    assert second.headers["task"] == "orders.paid"
    assert second.payload[0] == [["positional"]]


def test_celery_publisher_reports_an_unreachable_broker():
    from celery import Celery

    app = Celery("unreachable", set_as_current=False, broker="amqp://guest:guest@127.0.0.1:1//")
    app.conf.broker_connection_timeout = 1
    publisher = CeleryPublisher(app=app)
    with pytest.raises(BrokerUnavailable, match="unreachable"):
        publisher.publish(message())


def test_celery_publisher_sends_a_batch_in_order_through_one_producer(amqp_url):
    """On RabbitMQ: one producer (one connection and channel) for the whole batch, the tasks
    queued in the batch's order."""
    from celery import Celery

    app = Celery("batch-test", set_as_current=False, broker=amqp_url)
    queue = f"q-{uuid.uuid4().hex}"
    publisher = CeleryPublisher(app=app, task="tests.testapp.tasks.record_effect", queue=queue)
    batch = [message(payload={"name": f"n{n}"}) for n in range(5)]
    acquired = []
    pool = app.producer_pool
    real = pool.acquire

    def counted(*args, **kwargs):
        acquired.append(1)
        return real(*args, **kwargs)

    pool.acquire = counted
    try:
        assert publisher.publish_many(batch) == [None] * 5
        with app.connection_for_read() as connection:
            simple = connection.SimpleQueue(queue)
            received = [simple.get(timeout=5) for _ in batch]
            simple.close()
            Queue(queue)(connection.default_channel).delete()
    finally:
        app.close()
    assert acquired == [1]
    assert [m.headers["id"] for m in received] == [str(m.event_id) for m in batch]


def test_celery_publisher_with_confirms_sends_the_batch_then_awaits_its_confirms(amqp_url):
    """With ``confirm_publish`` on RabbitMQ the batch is sent whole on a channel that does not
    wait per message, then each task gets its own verdict: a queue that refuses publishes past
    its length nacks the rest of the batch, and only those fail."""
    from celery import Celery

    app = Celery("confirm-test", set_as_current=False, broker=amqp_url)
    app.conf.broker_transport_options = {"confirm_publish": True}
    name = f"q-{uuid.uuid4().hex}"
    capped = Queue(
        name,
        routing_key=name,
        queue_arguments={"x-max-length": 2, "x-overflow": "reject-publish"},
    )
    publisher = CeleryPublisher(app=app, task="tests.testapp.tasks.record_effect", queue=capped)
    try:
        results = publisher.publish_many([message(payload={"n": n}) for n in range(4)])
        channel = publisher._producer.channel
        assert "basic_publish" not in vars(channel)  # not py-amqp's wait-per-message publish
    finally:
        publisher.close()
        with app.connection_for_write() as connection:
            Queue(name)(connection.default_channel).delete()
        app.close()
    assert results[:2] == [None, None]
    assert [str(error) for error in results[2:]] == [
        "the broker refused the message (basic.nack)"
    ] * 2


@pytest.mark.parametrize("confirm_publish", [False, True])
def test_celery_publisher_fails_a_whole_batch_when_the_broker_is_unreachable(confirm_publish):
    from celery import Celery

    app = Celery("unreachable", set_as_current=False, broker="amqp://guest:guest@127.0.0.1:1//")
    app.conf.broker_connection_timeout = 1
    app.conf.broker_transport_options = {"confirm_publish": confirm_publish}
    results = CeleryPublisher(app=app).publish_many([message(), message()])
    assert [type(result) for result in results] == [BrokerUnavailable, BrokerUnavailable]


# --- webhook ----------------------------------------------------------------------------------


class Receiver:
    """A local HTTP server recording what it received; answers ``status``."""

    def __init__(self):
        self.requests = []
        self.paths = []
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), body))
                receiver.paths.append(self.path)
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


def test_webhook_legacy_scheme_posts_signed_json_with_the_event_id_as_idempotency_key(receiver):
    publisher = WebhookPublisher(
        url=receiver.url, secret="s3cret", timeout=5, signature_scheme="legacy"
    )
    sent = message(tenant="acme", traceparent=TRACEPARENT)
    publisher.publish(sent)
    publisher.publish(message())
    publisher.close()
    headers, body = receiver.requests[0]
    assert headers["Idempotency-Key"] == str(sent.event_id)
    assert headers["traceparent"] == TRACEPARENT
    assert "traceparent" not in {name.lower() for name in receiver.requests[1][0]}
    assert headers["Content-Type"] == "application/json"
    assert verify_signature("s3cret", body, headers["Webhook-Signature"])
    assert not verify_signature("other", body, headers["Webhook-Signature"])
    assert not verify_signature("s3cret", body + b" ", headers["Webhook-Signature"])
    envelope = json.loads(body)
    assert envelope["event_id"] == str(sent.event_id)
    assert envelope["topic"] == "orders.paid" and envelope["payload"] == {"total": "9.99"}
    assert envelope["headers"] == {"tenant": "acme"}


def test_webhook_signatures_expire():
    body = b"{}"
    header = f"t=1000,v1={sign('k', 1000, body)}"
    assert verify_signature("k", body, header, now=1100)
    assert not verify_signature("k", body, header, now=2000)
    assert not verify_signature("k", body, "v1=abc")
    assert not verify_signature("k", body, "t=x,v1=abc")


def test_webhook_non_2xx_is_a_failure(receiver):
    receiver.status = 503
    publisher = WebhookPublisher(url=receiver.url, secret=SECRET)
    with pytest.raises(PublishError, match="answered 503"):
        publisher.publish(message())
    publisher.close()


@pytest.mark.parametrize("status", [401, 403, 407])
def test_webhook_refused_credentials_are_a_configuration_error_for_the_whole_batch(
    receiver, status
):
    """The receiver refused the route's credentials or signature: no later message of the batch
    is sent to meet the same answer, and the URL's password stays out of the error."""
    receiver.status = status
    url = receiver.url.replace("http://", "http://hooks:pa55-w0rd@")
    publisher = WebhookPublisher(url=url, secret=SECRET)
    results = publisher.publish_many([message(), message(), message()])
    publisher.close()
    assert all(isinstance(result, BrokerConfigurationError) for result in results)
    assert results[0] is results[2] and len(receiver.requests) == 1
    assert f"answered {status}" in str(results[0]) and "pa55-w0rd" not in str(results[0])


def test_webhook_unreachable_fails_the_rest_of_the_batch():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    publisher = WebhookPublisher(url=f"http://127.0.0.1:{port}/", secret=SECRET, timeout=2)
    results = publisher.publish_many([message(), message()])
    publisher.close()
    assert all(isinstance(result, BrokerUnavailable) for result in results)


def test_webhook_needs_url_and_secret():
    with pytest.raises(IdempotencyConfigurationError, match="secret"):
        WebhookPublisher(url="http://x/", secret="")


def test_webhook_read_timeout_is_a_publish_error():
    import socket

    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        publisher = WebhookPublisher(url=url, secret=SECRET, timeout=0.5)
        with pytest.raises(PublishError, match="failed"):
            publisher.publish(message())
        publisher.close()
    finally:
        listener.close()


# --- webhook credentials never leak -------------------------------------------------------------

#: What a webhook URL may hold that no error, log line or stored field may show.
CREDENTIALS = ("hookuser", "s3cret", "XYZ", "abcdef0123456789abcdef")
WEBHOOK = "django_idempotency.publishers.webhook.WebhookPublisher"


def url_with_credentials(origin: str) -> str:
    scheme, _, host = origin.partition("://")
    return f"{scheme}://hookuser:s3cret@{host}/hooks/abcdef0123456789abcdef?token=XYZ"


def assert_no_credentials(text: str) -> None:
    for credential in CREDENTIALS:
        assert credential not in text, text


@contextlib.contextmanager
def failing_receiver(failure: str):
    """``scheme://127.0.0.1:<port>`` of a receiver that is down, answers 500, never answers, or
    speaks plain HTTP to a TLS client."""
    if failure in ("refused", "refused-tls"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        yield f"{'https' if failure == 'refused-tls' else 'http'}://127.0.0.1:{port}"
    elif failure in ("silent", "silent-tls"):
        listener = socket.create_server(("127.0.0.1", 0))  # connects, never answers
        try:
            port = listener.getsockname()[1]
            yield f"{'https' if failure == 'silent-tls' else 'http'}://127.0.0.1:{port}"
        finally:
            listener.close()
    else:
        server = Receiver()
        server.status = 500
        try:
            port = server.server.server_address[1]
            yield f"{'https' if failure == 'plain-to-tls' else 'http'}://127.0.0.1:{port}"
        finally:
            server.close()


FAILURES = [
    ("refused", BrokerUnavailable, r"unreachable: ConnectError \(Connection refused\)$"),
    ("refused-tls", BrokerUnavailable, r"unreachable: ConnectError \(Connection refused\)$"),
    ("500", PublishError, r"answered 500$"),
    ("silent", PublishError, r"failed: ReadTimeout$"),
    ("silent-tls", BrokerUnavailable, r"unreachable: ConnectTimeout$"),
    ("plain-to-tls", BrokerUnavailable, r"unreachable: ConnectError \(.*SSL.*\)$"),
]


@pytest.mark.parametrize(("failure", "error_type", "reason"), FAILURES)
def test_webhook_errors_show_a_redacted_url_and_never_a_credential(failure, error_type, reason):
    with failing_receiver(failure) as origin:
        publisher = WebhookPublisher(url=url_with_credentials(origin), secret=SECRET, timeout=0.5)
        with pytest.raises(error_type) as caught:
            publisher.publish(message())
        publisher.close()
    text = str(caught.value)
    assert text.startswith(f"webhook {origin}/hooks/***?token=*** ")
    assert re.search(reason, text), text
    assert_no_credentials(text)
    assert_no_credentials(repr(caught.value))
    # The whole chain, as a traceback in a log or an error tracker prints it.
    assert_no_credentials("".join(traceback.format_exception(caught.value)))


def record_text(record: logging.LogRecord) -> str:
    """Everything a handler could write of a record: message, extra fields, traceback."""
    exc_text = logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
    return f"{record.getMessage()} {record.__dict__!r} {exc_text}"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("failure", ["refused", "500", "silent", "silent-tls"])
def test_relay_stores_and_logs_webhook_failures_without_credentials(failure, caplog):
    caplog.set_level(logging.DEBUG)  # every logger: ours, the relay's, httpx's and httpcore's
    with failing_receiver(failure) as origin:
        options = {"url": url_with_credentials(origin), "secret": SECRET, "timeout": 0.5}
        routes = {"orders.*": {"BACKEND": WEBHOOK, "OPTIONS": options}}
        with settings_with(OUTBOX_PUBLISHERS=routes), Relay(rng=CeilingRandom()) as relay:
            event = publish_committed()
            assert relay.drain().failed == 1
    event.refresh_from_db()
    assert f"webhook {origin}/hooks/***?token=*** " in event.last_error
    assert_no_credentials(event.last_error)
    warnings = [r for r in caplog.records if r.name == "django_idempotency.outbox.announce"]
    assert [r.getMessage() for r in warnings] == ["outbox publish failed; will retry"]
    assert warnings[0].outbox_error == event.last_error
    if failure == "500":  # httpx logs every response it gets, with the URL it was given
        assert any(r.name == "httpx" and "***" in r.getMessage() for r in caplog.records)
    for record in caplog.records:
        assert_no_credentials(record_text(record))


def test_webhook_sends_its_real_url_while_httpx_only_sees_the_redacted_one(receiver, caplog):
    caplog.set_level(logging.DEBUG)
    url = url_with_credentials(receiver.url.removesuffix("/hooks/"))
    publisher = WebhookPublisher(url=url + "#fragment", secret=SECRET, timeout=5)
    publisher.publish(message())
    publisher.close()
    headers, _ = receiver.requests[0]
    assert receiver.paths == ["/hooks/abcdef0123456789abcdef?token=XYZ"]
    assert headers["Authorization"] == "Basic aG9va3VzZXI6czNjcmV0"  # hookuser:s3cret
    assert any(r.name == "httpx" for r in caplog.records)
    for record in caplog.records:
        assert_no_credentials(record_text(record))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # userinfo and fragment dropped; every query value masked, names kept
        ("https://u:p@host/hooks/?token=XYZ&b=&flag#f", "https://host/hooks/?token=***&b=***&***"),
        # 16+ characters that are not plain lowercase words: masked
        ("http://host:8080/h/abcdef0123456789abcdef/x", "http://host:8080/h/***/x"),
        ("http://host/services/T0/B0/QWERTYUIOPASDFGHJKLZXCVB", "http://host/services/T0/B0/***"),
        ("http://host/1b4e28ba-2fa1-11d2-883f-0016d3cca427/", "http://host/***/"),
        ("http://host/%41%42%43%44%45%46%47%48%49%4A%4B%4C%4D%4E%4F%50", "http://host/***"),
        ("http://host/zzzzzzzzzzzzzzzz", "http://host/***"),
        # plain words and short segments stay readable
        ("http://host/customer-notifications/v2/orders", "http://host/customer-notifications/v2/orders"),
        ("http://[::1]:9000/a_b.c/", "http://[::1]:9000/a_b.c/"),
        # a query name that looks like a secret is masked with its value
        ("http://host/?abcdef0123456789=1", "http://host/?***"),
        ("not a url", "not%20a%20url"),
        ("http://host:notaport/", "(invalid URL)"),
    ],
)  # fmt: skip
def test_redact_url_rule(url, shown):
    assert redact_url(url) == shown


def test_secret_path_segments_masks_short_secrets_by_position():
    url = "https://hooks.example/catch/123/abc1/"
    assert redact_url(url) == url
    assert redact_url(url, secret_segments=[2]) == "https://hooks.example/catch/123/***/"
    assert redact_url(url, secret_segments=[-2, 9]) == "https://hooks.example/catch/123/***/"
    publisher = WebhookPublisher(url=url, secret=SECRET, secret_path_segments=[2])
    assert str(publisher.shown_url) == "https://hooks.example/catch/123/***/"
    publisher.close()


@pytest.mark.parametrize(
    "url",
    ["ftp://hookuser:s3cret@host/XYZ", "hookuser:s3cret@XYZ", "http://hookuser:s3cret@:1/XYZ"],
)
def test_webhook_url_errors_never_quote_the_url(url):
    with pytest.raises(IdempotencyConfigurationError, match="'url' must be an absolute") as caught:
        WebhookPublisher(url=url, secret=SECRET)
    assert_no_credentials(str(caught.value))


# --- AMQP (RabbitMQ) --------------------------------------------------------------------------


@pytest.fixture
def rabbit(amqp_url):
    """A fresh exchange with one queue bound to every routing key; deleted afterwards."""
    name = f"test-outbox-{uuid.uuid4().hex}"
    exchange = Exchange(name, type="topic", durable=True)
    queue = Queue(name, exchange=exchange, routing_key="orders.#", durable=False, auto_delete=False)
    with Connection(amqp_url) as connection:
        queue(connection.default_channel).declare()

        def drain(expected, timeout=30):
            received = []
            with Connection(amqp_url) as reader:
                bound = queue(reader.default_channel)
                import time

                deadline = time.monotonic() + timeout
                while len(received) < expected and time.monotonic() < deadline:
                    got = bound.get(no_ack=True)
                    if got is None:
                        time.sleep(0.05)
                    else:
                        received.append(got)
            return received

        yield {"url": amqp_url, "exchange": name, "drain": drain}
        channel = connection.default_channel
        queue(channel).delete()
        exchange(channel).delete()


def test_amqp_publishes_persistent_messages_with_the_event_id(rabbit):
    publisher = AMQPPublisher(url=rabbit["url"], exchange=rabbit["exchange"])
    batch = [message(payload={"n": n}, tenant="acme", traceparent=TRACEPARENT) for n in range(4)]
    batch.append(message(payload={"n": 4}, tenant="acme"))
    assert publisher.publish_many(batch) == [None] * 5
    publisher.close()
    received = rabbit["drain"](5)
    assert [m.properties["message_id"] for m in received] == [str(b.event_id) for b in batch]
    first = received[0]
    assert first.delivery_info["routing_key"] == "orders.paid"
    assert first.properties["delivery_mode"] == 2
    assert first.properties["type"] == "orders.paid"
    assert first.headers["event_id"] == str(batch[0].event_id)
    assert first.headers["tenant"] == "acme" and first.headers["event_key"] == "order-1"
    assert first.headers["traceparent"] == TRACEPARENT
    assert "traceparent" not in received[4].headers
    assert json.loads(first.body) == {"n": 0}


def test_amqp_unroutable_messages_fail_instead_of_vanishing(rabbit):
    publisher = AMQPPublisher(url=rabbit["url"], exchange=rabbit["exchange"])
    routed, unrouted = message(), message(topic="invoices.sent")
    results = publisher.publish_many([routed, unrouted])
    publisher.publish(message())  # the channel stays usable
    publisher.close()
    assert results[0] is None
    assert isinstance(results[1], PublishError) and "unroutable" in str(results[1])


def test_amqp_missing_exchange_without_declare_is_a_configuration_error_and_recovers(rabbit):
    publisher = AMQPPublisher(
        url=rabbit["url"], exchange=f"missing-{uuid.uuid4().hex}", declare=False
    )
    results = publisher.publish_many([message(), message()])
    assert all(isinstance(result, BrokerConfigurationError) for result in results)
    assert "NOT_FOUND - no exchange" in str(results[0])
    assert publisher._connection is None
    publisher.exchange = rabbit["exchange"]  # the route fixed: the next batch connects afresh
    assert publisher.publish_many([message()]) == [None]
    publisher.close()


def _with_password(url, password):
    """``url`` with its password replaced."""
    return re.sub(r"(amqp://[^:/@]+:)[^@]*@", rf"\g<1>{password}@", url)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong password", "ACCESS_REFUSED - Login was refused"),
        ("no such virtual host", "NOT_ALLOWED - vhost"),
        ("the exchange declared with another type", "PRECONDITION_FAILED - inequivalent arg"),
    ],
)
def test_amqp_refusals_of_the_route_are_configuration_errors(rabbit, case, expected):
    """RabbitMQ answered and refused: not an unreachable broker (NOT_ALLOWED is a connection
    error to kombu, which used to make it one)."""
    url, exchange_type = rabbit["url"], "topic"
    if case == "wrong password":
        url = _with_password(url, "wr0ng-pa55")
    elif case == "no such virtual host":
        url = url.rstrip("/") + f"/no-such-vhost-{uuid.uuid4().hex[:8]}"
    else:
        exchange_type = "direct"
    publisher = AMQPPublisher(
        url=url, exchange=rabbit["exchange"], exchange_type=exchange_type, connect_timeout=5
    )
    results = publisher.publish_many([message(), message()])
    publisher.close()
    assert all(isinstance(result, BrokerConfigurationError) for result in results), results
    assert expected in str(results[0]) and "pa55" not in str(results[0])


def test_amqp_needs_url_and_exchange():
    with pytest.raises(IdempotencyConfigurationError, match="exchange"):
        AMQPPublisher(url="amqp://x//", exchange="")


@pytest.mark.django_db(transaction=True)
def test_relay_loses_nothing_while_rabbitmq_is_cut_off(rabbit):
    with tcp_proxy(rabbit["url"], 5672) as proxy:
        routes = {
            "orders.*": {
                "BACKEND": "django_idempotency.publishers.amqp.AMQPPublisher",
                "OPTIONS": {
                    "url": proxy.url_for(rabbit["url"]),
                    "exchange": rabbit["exchange"],
                    "connect_timeout": 2,
                    "confirm_timeout": 5,
                },
            }
        }
        with settings_with(OUTBOX_PUBLISHERS=routes), Relay(rng=CeilingRandom()) as relay:
            before = [publish_committed(payload={"n": n}) for n in range(3)]
            assert relay.drain().published == 3
            proxy.cut()
            during = [publish_committed(payload={"n": n}, key="k") for n in range(3, 8)]
            stats = relay.drain()
            assert stats.published == 0 and stats.failed == 1  # the key's first; the rest wait
            pending = OutboxEvent.objects.pending()
            assert pending.count() == 5
            assert pending.filter(attempts=1).count() == 1
            assert "unreachable" in pending.get(attempts=1).last_error
            proxy.restore()
            OutboxEvent.objects.update(next_attempt_at=timezone.now())
            assert relay.drain().published == 5
    received = rabbit["drain"](8)
    assert [m.properties["message_id"] for m in received] == [
        str(e.event_id) for e in before + during
    ]
    assert rabbit["drain"](1, timeout=0.5) == []  # nothing twice


def test_amqp_keeps_no_confirm_state_between_batches_and_connections(rabbit):
    publisher = AMQPPublisher(url=rabbit["url"], exchange=rabbit["exchange"])
    for _ in range(2):
        assert publisher.publish_many([message(), message(), message()]) == [None] * 3
        confirms = publisher._confirms
        assert confirms is not None and confirms.pending == set() and confirms.settled == {}
        publisher.close()  # the next batch reconnects, and delivery tags restart at 1
    assert len(rabbit["drain"](6)) == 6


def test_amqp_confirms_settle_only_awaited_tags():
    class Channel:
        def __init__(self):
            self.events = {"basic_ack": set(), "basic_nack": set()}

        def confirm_select(self):
            pass

    channel = Channel()
    confirms = Confirms(channel)
    assert [confirms.sent() for _ in range(5)] == [1, 2, 3, 4, 5]
    confirms.pending = {3, 4, 5}
    (on_ack,), (on_nack,) = channel.events["basic_ack"], channel.events["basic_nack"]
    on_ack(4, True)  # "everything up to 4": only 3 and 4 were awaited
    on_nack(5, False)
    on_ack(9, False)  # not awaited: ignored
    assert confirms.settled == {3: True, 4: True, 5: False}
    assert confirms.pending == set()
    publisher = AMQPPublisher(url="amqp://unused//", exchange="x")
    publisher._confirms = confirms
    assert isinstance(publisher._outcome(5, message()), PublishError)
    assert publisher._outcome(4, message()) is None
    assert "no publisher confirm" in str(publisher._outcome(7, message()))
