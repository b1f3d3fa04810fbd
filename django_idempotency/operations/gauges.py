"""The outbox's gauges for Prometheus (:class:`OutboxCollector`), read from the database when
scraped: the health panel's bounded reads, served as metrics.

Optional: the ``metrics`` extra (``prometheus_client``).
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, connections, router
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric

from django_idempotency.conf import conf
from django_idempotency.models import OutboxEvent
from django_idempotency.observability.metrics import PREFIX
from django_idempotency.operations import health

__all__ = ["OutboxCollector"]

logger = logging.getLogger(__name__)


class OutboxCollector:
    """The outbox's backlog, the age of its oldest pending event, its DEAD events and those
    failing on a configuration error, read from the database each time the registry is
    scraped.

    Register it on the registry you serve, once: ``REGISTRY.register(OutboxCollector())`` in a
    single process, or beside ``MultiProcessCollector`` in the metrics view under gunicorn.
    Being read at scrape time, the values are never stale and never summed over processes,
    and no relay has to be running for them to be right. The reads are the health panel's:
    bounded, through the relay index (exact up to 10,000 rows; above that PostgreSQL's planner
    estimate, or 10,000 elsewhere, a lower bound).
    """

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def describe(self) -> list[Metric]:
        # Names only, so registering never touches the database.
        return list(_outbox_families())

    def collect(self) -> list[Metric]:
        if not conf.METRICS:
            return []
        try:
            outbox = self._read()
        except DatabaseError:
            logger.warning("outbox gauges: the database could not be read", exc_info=True)
            return []
        pending, oldest, dead, misconfigured, held = _outbox_families()
        pending.add_metric([], outbox.pending.value)
        age = 0.0
        if outbox.oldest_pending_at is not None:
            age = max((timezone.now() - outbox.oldest_pending_at).total_seconds(), 0.0)
        oldest.add_metric([], age)
        dead.add_metric([], outbox.dead.value)
        misconfigured.add_metric([], outbox.configuration_errors.value)
        held.add_metric([], outbox.held.value)
        return [pending, oldest, dead, misconfigured, held]

    def _read(self) -> health.OutboxHealth:
        alias = self.using or router.db_for_read(OutboxEvent)
        connection = connections[alias]
        # A scrape may come on a thread of its own (start_http_server): leave no connection
        # open behind it, but never close one a request was using.
        opened_here = connection.connection is None
        try:
            return health.outbox_health(alias)
        finally:
            if opened_here and not connection.in_atomic_block:
                connection.close()


def _outbox_families() -> tuple[
    GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily
]:
    return (
        GaugeMetricFamily(
            PREFIX + "outbox_pending_events",
            "Outbox events waiting to be published (PENDING): the relay's backlog.",
        ),
        GaugeMetricFamily(
            PREFIX + "outbox_oldest_pending_age_seconds",
            "Age of the oldest PENDING outbox event; 0 when none waits.",
        ),
        GaugeMetricFamily(
            PREFIX + "outbox_dead_events",
            "Outbox events that are DEAD and wait for a person to retry or discard them.",
        ),
        GaugeMetricFamily(
            PREFIX + "outbox_configuration_error_events",
            "PENDING outbox events whose latest attempt failed on a configuration error (the "
            "broker refused the route: credentials, permissions, a missing stream or exchange; "
            "or no route): retried every OUTBOX_BACKOFF_MAX_SECONDS until a person fixes it. "
            "Counted among the first 10,000 pending events: a lower bound above that.",
        ),
        GaugeMetricFamily(
            PREFIX + "outbox_held_events",
            "Outbox events HELD behind a failed (backing off or DEAD) event of their key: they "
            "follow it once it is published, retried or discarded.",
        ),
    )
