"""Prometheus counters and histograms, fed by the signals in ``signals.py``.

Optional: ``pip install 'django-idempotency[metrics]'``. ``AppConfig.ready()`` connects the
receivers when ``prometheus_client`` imports; ``IDEMPOTENCY["METRICS"] = False`` makes them do
nothing. The metrics live in prometheus_client's default registry, so whatever exposes that
registry (``prometheus_client.start_http_server``, django-prometheus, a view of your own, or
``MultiProcessCollector`` under gunicorn) serves them; see docs/metrics.md.

No label carries a scope or a key: their number is unbounded, which would blow up the series.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.dispatch import Signal
from prometheus_client import Counter, Histogram

from django_idempotency import signals
from django_idempotency.conf import conf

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

Receiver = Callable[..., None]


def _counting(counter: Counter, **labels: str) -> Receiver:
    child = counter.labels(**labels) if labels else counter

    def receiver(sender: Any, **kwargs: Any) -> None:
        if conf.METRICS:
            child.inc()

    return receiver


def _count_release(sender: Any, *, reason: str = "unknown", **kwargs: Any) -> None:
    if conf.METRICS:
        RELEASES.labels(reason=reason).inc()


def _time_claim(sender: Any, *, outcome: str, duration: float, **kwargs: Any) -> None:
    if conf.METRICS:
        CLAIM_DURATION.labels(outcome=outcome).observe(duration)


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
    (signals.key_released, _count_release),
    (signals.claim_finished, _time_claim),
)


def connect() -> None:
    """Connect every receiver once (``dispatch_uid`` makes a second call harmless)."""
    for index, (signal, receiver) in enumerate(RECEIVERS):
        signal.connect(receiver, dispatch_uid=f"django_idempotency.metrics.{index}")
