"""OpenTelemetry spans for claim, replay and completion, and the traceparent helpers."""

from __future__ import annotations

import pytest
from django.http import HttpResponse
from django.test import override_settings
from opentelemetry.trace import SpanKind, StatusCode

from django_idempotency.core import types
from django_idempotency.exceptions import LeaseLostConflict
from django_idempotency.observability import tracing
from django_idempotency.request import lifecycle
from django_idempotency.request.keys import redact
from tests.support.factories import age_record


def by_name(exporter):
    return {span.name: span for span in exporter.get_finished_spans()}


def post(client, key, **body):
    return client.post(
        "/api/widget/", {"name": "a", **body}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )


@pytest.mark.django_db(transaction=True)
def test_claim_and_completion_spans_are_children_of_the_request(client, key, spans, tracer):
    with tracer.start_as_current_span("POST /api/widget/") as request_span:
        assert post(client, key).status_code == 201
    finished = by_name(spans)
    claim, complete = finished["idempotency.claim"], finished["idempotency.complete"]
    request_id = request_span.get_span_context().span_id
    assert claim.parent.span_id == request_id
    assert complete.parent.span_id == request_id
    assert claim.attributes["idempotency.outcome"] == "claimed"
    assert claim.attributes["idempotency.scope"] == "anonymous"
    assert claim.attributes["idempotency.key"] == redact(key)  # never the raw key by default
    assert claim.attributes["http.request.method"] == "POST"
    assert complete.attributes["http.response.status_code"] == 201
    assert complete.attributes["idempotency.outcome"] == "completed"


@pytest.mark.django_db(transaction=True)
def test_a_retry_gets_claim_and_replay_spans(client, key, spans):
    post(client, key)
    spans.clear()
    assert post(client, key)["Idempotent-Replay"] == "true"
    finished = by_name(spans)
    assert set(finished) == {"idempotency.claim", "idempotency.replay"}
    assert finished["idempotency.claim"].attributes["idempotency.outcome"] == "replayed"
    assert finished["idempotency.replay"].attributes["http.response.status_code"] == 201


@pytest.mark.django_db(transaction=True)
def test_raw_keys_only_with_log_keys(client, key, spans):
    with override_settings(IDEMPOTENCY={"LOG_KEYS": True}):
        post(client, key)
    assert by_name(spans)["idempotency.claim"].attributes["idempotency.key"] == key


@pytest.mark.django_db(transaction=True)
def test_a_lost_lease_marks_the_completion_span_as_an_error(key, spans):
    identity = types.Identity("anonymous", key, "f" * 64, "POST", "/api/widget/")
    first = lifecycle.claim(identity)
    age_record("anonymous", key, 31)
    lifecycle.claim(identity)
    with pytest.raises(LeaseLostConflict):
        lifecycle.run(first.lease, lambda: HttpResponse(status=201))
    complete = by_name(spans)["idempotency.complete"]
    assert complete.status.status_code == StatusCode.ERROR
    assert complete.attributes["idempotency.outcome"] == "lease_lost"
    assert complete.events[0].name == "exception"


@pytest.mark.django_db(transaction=True)
def test_switched_off(client, key, spans, tracer):
    with override_settings(IDEMPOTENCY={"TRACING": False}):
        with tracer.start_as_current_span("request"):
            post(client, key)
            assert tracing.current_traceparent() is None
        with tracing.consumer_span("consume", None) as span:
            assert span is None
    assert set(by_name(spans)) == {"request"}


def test_current_traceparent_is_the_w3c_header_of_the_current_span(spans, tracer):
    assert tracing.current_traceparent() is None  # no span, nothing to store
    with tracer.start_as_current_span("request") as span:
        context = span.get_span_context()
        assert tracing.current_traceparent() == (
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
        )


def test_consumer_span_links_back_to_the_request_that_published(spans, tracer):
    with tracer.start_as_current_span("POST /api/orders/") as request_span:
        stored = tracing.current_traceparent()  # what the outbox keeps with the event
    # Later, in a worker, with no trace of its own yet:
    with tracing.consumer_span("orders.created process", stored, attributes={"a": 1}) as span:
        assert span is not None
    consumer = by_name(spans)["orders.created process"]
    request_context = request_span.get_span_context()
    assert consumer.kind == SpanKind.CONSUMER
    assert consumer.attributes["a"] == 1
    assert [link.context.span_id for link in consumer.links] == [request_context.span_id]
    assert consumer.links[0].context.trace_id == request_context.trace_id
    assert consumer.context.trace_id != request_context.trace_id  # its own trace, linked


@pytest.mark.parametrize("stored", [None, "", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])
def test_consumer_span_without_a_usable_traceparent_has_no_link(spans, stored):
    with tracing.consumer_span("consume", stored):
        pass
    assert by_name(spans)["consume"].links == ()
