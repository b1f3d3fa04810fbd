"""Traces across the outbox: an event keeps the traceparent of the request that published it,
every publisher sends it on, the relay's span and the consumer's span link back to it."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery
from celery.worker.request import Request
from django.db import transaction
from django.test import Client
from opentelemetry.trace import SpanKind, StatusCode

from django_idempotency.inbox import consume_once
from django_idempotency.models import OutboxEvent
from django_idempotency.observability import tracing
from django_idempotency.outbox import publish
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import publish_committed, relay_all, settings_with
from tests.testapp import tasks  # noqa: F401  (registers the task on every Celery app)
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

CELERY_TASK = "tests.testapp.tasks.record_effect"


def w3c(span) -> str:
    """The W3C traceparent of a span (an SDK span, live or finished)."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def named(spans, name: str) -> list:
    return [span for span in spans.get_finished_spans() if span.name == name]


def linked_to(span) -> list[str]:
    return [f"{link.context.trace_id:032x}-{link.context.span_id:016x}" for link in span.links]


def ids(span) -> str:
    return f"{span.context.trace_id:032x}-{span.context.span_id:016x}"


@pytest.fixture
def memory_broker():
    broker.clear()
    yield broker
    broker.clear()


def test_publish_keeps_the_traceparent_of_the_current_span(spans, tracer):
    with tracer.start_as_current_span("POST /orders/") as request_span:
        traced = publish_committed()
    untraced = publish_committed()
    with settings_with(TRACING=False), tracer.start_as_current_span("not recorded"):
        switched_off = publish_committed()
    stored = dict(OutboxEvent.objects.values_list("pk", "traceparent"))
    assert stored == {traced.pk: w3c(request_span), untraced.pk: None, switched_off.pk: None}


def test_the_relay_sends_it_on_and_links_its_publish_span_to_each_request(
    spans, tracer, memory_broker
):
    with tracer.start_as_current_span("request A") as first:
        publish_committed(payload={"n": 1})
        publish_committed(payload={"n": 2})
    with tracer.start_as_current_span("request B") as second:
        publish_committed(payload={"n": 3})
    publish_committed(payload={"n": 4})
    spans.clear()
    relay_all()
    sent = {message.payload["n"]: message.traceparent for message in memory_broker.snapshot()}
    assert sent == {1: w3c(first), 2: w3c(first), 3: w3c(second), 4: None}
    (send,) = named(spans, "outbox.publish")
    assert send.kind == SpanKind.PRODUCER
    assert linked_to(send) == [ids(first), ids(second)]  # one link per request
    assert send.parent is None  # the relay's own trace
    assert dict(send.attributes) == {
        "messaging.operation.type": "send",
        "messaging.batch.message_count": 4,
        "messaging.destination.name": "orders.paid",
        "outbox.publisher": "MemoryPublisher",
        "outbox.failed": 0,
    }
    assert send.status.status_code == StatusCode.UNSET


def test_a_failing_send_marks_the_publish_span(spans, memory_broker):
    publish_committed(topic="orders.paid")
    publish_committed(topic="orders.shipped")
    memory_broker.fail_when(lambda message: message.topic == "orders.shipped")
    relay_all()
    (send,) = named(spans, "outbox.publish")
    assert send.status.status_code == StatusCode.ERROR
    assert "injected failure" in send.status.description
    assert send.attributes["outbox.failed"] == 1
    assert "messaging.destination.name" not in send.attributes  # two topics in the batch


def test_consume_once_opens_a_consumer_span_linked_to_the_message(spans, tracer):
    with tracer.start_as_current_span("POST /orders/") as request_span:
        traceparent = tracing.current_traceparent()
    with consume_once("billing", "m-1", traceparent=traceparent) as consumption:
        assert consumption
        with transaction.atomic():
            downstream = publish("invoices.due", {"order": 1})  # a handler publishing on
    with consume_once("billing", "m-1", traceparent=traceparent) as consumption:
        assert not consumption
    first, duplicate = named(spans, "outbox.consume")
    for span in (first, duplicate):
        assert span.kind == SpanKind.CONSUMER
        assert linked_to(span) == [ids(request_span)]
        assert span.context.trace_id != request_span.get_span_context().trace_id
        assert span.attributes["messaging.message.id"] == "m-1"
        assert span.attributes["idempotency.consumer"] == "billing"
    assert (
        first.attributes["idempotency.duplicate"],
        duplicate.attributes["idempotency.duplicate"],
    ) == (False, True)
    # The event the handler published carries the consumer's span: the chain goes on.
    downstream.refresh_from_db()
    assert downstream.traceparent == w3c(first)


def test_a_failing_handler_marks_its_consumer_span(spans):
    with pytest.raises(RuntimeError), consume_once("billing", "m-2"):
        raise RuntimeError("handler failed")
    (span,) = named(spans, "outbox.consume")
    assert span.status.status_code == StatusCode.ERROR
    assert span.events[0].name == "exception"
    assert span.links == ()  # no traceparent: no link, still a span


def test_a_celery_worker_links_the_task_to_the_request_through_the_message_header(spans, tracer):
    """Relayed by the Celery publisher, run by Celery's own worker request code."""
    app = Celery("tracing-test", set_as_current=False, broker="memory://")
    queue = f"q-{uuid.uuid4().hex}"
    routes = {
        "widgets.*": {
            "BACKEND": "django_idempotency.publishers.celery.CeleryPublisher",
            "OPTIONS": {"app": app, "task": CELERY_TASK, "queue": queue},
        }
    }
    with (
        tracer.start_as_current_span("POST /widgets/") as request_span,
        settings_with(OUTBOX_PUBLISHERS=routes),
        transaction.atomic(),
    ):
        event = publish("widgets.created", {"name": "traced"})
    with settings_with(OUTBOX_PUBLISHERS=routes):
        relay_all()
    with app.connection_for_read() as connection:
        inbox = connection.SimpleQueue(queue)
        message = inbox.get(timeout=5)
        assert message.headers["traceparent"] == w3c(request_span)
        Request(message, app=app, task=app.tasks[CELERY_TASK]).execute()
        inbox.close()
    (consume,) = named(spans, "outbox.consume")
    assert linked_to(consume) == [ids(request_span)]
    assert consume.attributes["messaging.message.id"] == str(event.event_id)
    assert consume.attributes["idempotency.consumer"] == CELERY_TASK
    assert Widget.objects.filter(name="traced").count() == 1


def test_an_http_request_links_to_the_consumer_of_the_event_it_published(spans, memory_broker):
    """End to end: a server span from opentelemetry-instrumentation-django, the view publishes,
    the relay sends through the in-memory publisher, the consumer runs."""
    from opentelemetry.instrumentation.django import DjangoInstrumentor

    instrumentor = DjangoInstrumentor()
    instrumentor.instrument()
    try:
        response = Client().post(
            "/plain/publish/",
            {"name": "w-1"},
            content_type="application/json",
            headers={"Idempotency-Key": "publish-1"},
        )
    finally:
        instrumentor.uninstrument()
    assert response.status_code == 201, response.content
    (server,) = [span for span in spans.get_finished_spans() if span.kind == SpanKind.SERVER]
    assert named(spans, "idempotency.claim")[0].parent.span_id == server.context.span_id

    relay_all()
    (message,) = memory_broker.snapshot()
    assert str(message.event_id) == response.json()["event_id"]
    with consume_once("widgets", message.event_id, traceparent=message.traceparent) as consumed:
        assert consumed

    (consume,) = named(spans, "outbox.consume")
    (send,) = named(spans, "outbox.publish")
    assert linked_to(consume) == [ids(server)]
    assert linked_to(send) == [ids(server)]
    assert consume.context.trace_id != server.context.trace_id  # linked, not parented
