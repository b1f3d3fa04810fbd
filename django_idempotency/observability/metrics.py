"""Prometheus counters and histograms fed by the signals in ``signals.py``. The outbox gauges,
read from the database when scraped, are ``operations.gauges.OutboxCollector``.

Optional: the ``metrics`` extra. ``AppConfig.ready()`` connects the
receivers when ``prometheus_client`` imports; ``IDEMPOTENCY["METRICS"] = False`` makes them do
nothing. The metrics live in prometheus_client's default registry, so whatever exposes that
registry (``prometheus_client.start_http_server``, django-prometheus, a view of your own, or
``MultiProcessCollector`` under gunicorn) serves them; see docs/metrics.md.

No label carries a scope or a key: their number is unbounded, which would blow up the series.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal
from prometheus_client import Counter, Histogram

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.core.failures import failure_kind

__all__ = [
    "CLAIMS",
    "CLAIM_DURATION",
    "COMPLETIONS",
    "CONSUMER_DUPLICATES",
    "INBOX_FAILURES_FORGOTTEN",
    "LEASES_LOST",
    "OUTBOX_DEAD",
    "OUTBOX_OPERATOR_ACTIONS",
    "OUTBOX_OPERATOR_EVENTS",
    "OUTBOX_PUBLISHED",
    "OUTBOX_PUBLISH_FAILURES",
    "OUTBOX_PUBLISH_LATENCY",
    "PREFIX",
    "RECEIVERS",
    "RELEASES",
    "Receiver",
    "SWEPT_ROWS",
    "TAKEOVERS",
    "connect",
]

logger = logging.getLogger(__name__)

PREFIX = "django_idempotency_"

CLAIMS = Counter(
    PREFIX + "claims",
    "Idempotency-key claims by outcome: claimed (the request runs), replayed, conflicted (409), "
    "mismatched (422).",
    ["outcome"],
)
TAKEOVERS = Counter(
    PREFIX + "takeovers",
    "Claims that took over a key whose lease had expired (the previous request died or overran).",
)
LEASES_LOST = Counter(
    PREFIX + "leases_lost",
    "Requests whose completion found the key taken over; their writes were rolled back.",
)
COMPLETIONS = Counter(PREFIX + "completions", "Responses stored for replay.")
RELEASES = Counter(
    PREFIX + "releases",
    "Keys released so they can be used again, by reason: exception, not_stored, admin.",
    ["reason"],
)
CLAIM_DURATION = Histogram(
    PREFIX + "claim_duration_seconds",
    "Time to decide a claim (database round trips included), by outcome.",
    ["outcome"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

OUTBOX_PUBLISHED = Counter(
    PREFIX + "outbox_events_published",
    "Outbox events the broker accepted, by publisher class.",
    ["publisher"],
)
OUTBOX_PUBLISH_LATENCY = Histogram(
    PREFIX + "outbox_publish_latency_seconds",
    "Time from publish() in the business transaction to the broker accepting the event.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0),
)
OUTBOX_PUBLISH_FAILURES = Counter(
    PREFIX + "outbox_publish_failures",
    "Failed attempts to publish an outbox event, by reason: unreachable (the broker could not "
    "be reached), configuration (the broker refused the route: credentials, permissions, a "
    "missing stream or exchange), other.",
    ["reason"],
)
OUTBOX_DEAD = Counter(
    PREFIX + "outbox_events_dead",
    "Outbox events that failed OUTBOX_MAX_ATTEMPTS times and went DEAD.",
)
OUTBOX_OPERATOR_ACTIONS = Counter(
    PREFIX + "outbox_operator_actions",
    "Actions an operator took on failed outbox events (the admin's, or the operations "
    "functions), by action (retry, discard) and target (selection, failure_group).",
    ["action", "target"],
)
OUTBOX_OPERATOR_EVENTS = Counter(
    PREFIX + "outbox_operator_events",
    "Failed outbox events an operator retried or discarded, by action and target.",
    ["action", "target"],
)
INBOX_FAILURES_FORGOTTEN = Counter(
    PREFIX + "inbox_failures_forgotten",
    "Records of failed messages an operator forgot, by target (selection, failure_group).",
    ["target"],
)
CONSUMER_DUPLICATES = Counter(
    PREFIX + "consumer_duplicates_skipped",
    "Messages a consumer had handled already and skipped, by consumer.",
    ["consumer"],
)
SWEPT_ROWS = Counter(
    PREFIX + "swept_rows",
    "Rows the sweeps deleted, by sweep: idempotency_records, outbox_events, processed_messages.",
    ["sweep"],
)

Receiver = Callable[..., None]


def _counting(counter: Counter, **labels: str) -> Receiver:
    child = counter.labels(**labels) if labels else counter

    def receiver(sender: Any, **kwargs: Any) -> None:
        if conf.METRICS:
            child.inc()

    return receiver


def _counting_by(counter: Counter, label: str, *, amount: str | None = None) -> Receiver:
    """Count by the signal's ``label`` argument; by its ``amount`` argument instead of 1."""

    def receiver(sender: Any, **kwargs: Any) -> None:
        if conf.METRICS:
            child = counter.labels(**{label: str(kwargs.get(label) or "unknown")})
            child.inc(kwargs[amount] if amount else 1)

    return receiver


def _time_claim(sender: Any, *, outcome: str, duration: float, **kwargs: Any) -> None:
    if conf.METRICS:
        CLAIM_DURATION.labels(outcome=outcome).observe(duration)


def _count_published(sender: Any, *, events: list[Any], publisher: str = "", **kwargs: Any) -> None:
    if conf.METRICS:
        OUTBOX_PUBLISHED.labels(publisher=publisher or "unknown").inc(len(events))
        observe = OUTBOX_PUBLISH_LATENCY.observe
        for event in events:
            if event.published_at is not None and event.created_at is not None:
                observe(max((event.published_at - event.created_at).total_seconds(), 0.0))


def _count_publish_failure(sender: Any, *, error: BaseException, **kwargs: Any) -> None:
    if conf.METRICS:
        OUTBOX_PUBLISH_FAILURES.labels(reason=failure_kind(error).value).inc()


def _counting_operator(action: str) -> Receiver:
    """Count an operator's action on outbox events, and the events it changed."""

    def receiver(
        sender: Any, *, count: int, failure_group: str | None = None, **kwargs: Any
    ) -> None:
        if conf.METRICS:
            target = "selection" if failure_group is None else "failure_group"
            OUTBOX_OPERATOR_ACTIONS.labels(action=action, target=target).inc()
            OUTBOX_OPERATOR_EVENTS.labels(action=action, target=target).inc(count)

    return receiver


def _count_forgotten(
    sender: Any, *, count: int, failure_group: str | None = None, **kwargs: Any
) -> None:
    if conf.METRICS:
        target = "selection" if failure_group is None else "failure_group"
        INBOX_FAILURES_FORGOTTEN.labels(target=target).inc(count)


#: Each signal and the receiver that counts it; the receivers are held here, so the signals can
#: keep their default weak references.
RECEIVERS: tuple[tuple[Signal, Receiver], ...] = (
    (signals.key_claimed, _counting(CLAIMS, outcome="claimed")),
    (signals.response_replayed, _counting(CLAIMS, outcome="replayed")),
    (signals.request_conflicted, _counting(CLAIMS, outcome="conflicted")),
    (signals.payload_mismatched, _counting(CLAIMS, outcome="mismatched")),
    (signals.key_taken_over, _counting(TAKEOVERS)),
    (signals.lease_lost, _counting(LEASES_LOST)),
    (signals.request_completed, _counting(COMPLETIONS)),
    (signals.key_released, _counting_by(RELEASES, "reason")),
    (signals.claim_finished, _time_claim),
    (signals.events_published, _count_published),
    (signals.publish_failed, _count_publish_failure),
    (signals.event_dead, _counting(OUTBOX_DEAD)),
    (signals.duplicate_skipped, _counting_by(CONSUMER_DUPLICATES, "consumer")),
    (signals.rows_swept, _counting_by(SWEPT_ROWS, "sweep", amount="count")),
    (signals.events_retried, _counting_operator("retry")),
    (signals.events_discarded, _counting_operator("discard")),
    (signals.failures_forgotten, _count_forgotten),
)


def connect() -> None:
    """Connect every receiver once (``dispatch_uid`` makes a second call harmless)."""
    for index, (signal, receiver) in enumerate(RECEIVERS):
        signal.connect(receiver, dispatch_uid=f"django_idempotency.observability.metrics.{index}")
