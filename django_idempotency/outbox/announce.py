"""Tell the project what an acknowledged batch did: signals, logs, and the route failures.

Only after the acknowledgement committed, so a receiver that reads the event sees its new state,
and only for the events this relay still held: a batch taken over meanwhile is announced by the
relay that sends it again.
"""

from __future__ import annotations

import logging
from typing import Any

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.core.failures import FailureKind, describe, failure_kind
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.ack import Acknowledged
from django_idempotency.outbox.report import RouteFailures

__all__ = ["announce"]

logger = logging.getLogger(__name__)


def announce(
    acknowledged: Acknowledged, publisher_names: dict[int, str], route_failures: RouteFailures
) -> None:
    """Send the signals and write the logs of ``acknowledged``, and count its failures by route;
    completes its stats (published, failed, dead). ``publisher_names``: the class each event
    went to, by event id, taken out as it is announced."""
    stats, now = acknowledged.stats, acknowledged.now
    by_publisher: dict[str, list[OutboxEvent]] = {}
    for event in acknowledged.sent:
        event.status, event.published_at = OutboxStatus.PUBLISHED, now
        event.locked_until = event.relay_token = None
        publisher = publisher_names.pop(event.pk, "")
        by_publisher.setdefault(publisher, []).append(event)
        signals.event_published.send(sender=OutboxEvent, event=event, publisher=publisher)
    for publisher, events in by_publisher.items():
        signals.events_published.send(sender=OutboxEvent, events=events, publisher=publisher)
    stats.published = len(acknowledged.sent)
    for failure in acknowledged.failures:
        event, error = failure.event, failure.error
        event.locked_until = event.relay_token = None
        dead = event.status == OutboxStatus.DEAD
        extra = _log_extra(event, error)
        route_failures.count(event, error, dead=dead, publisher=publisher_names.pop(event.pk, ""))
        signals.publish_failed.send(
            sender=OutboxEvent,
            event=event,
            error=error,
            attempts=event.attempts,
            next_attempt_at=None if dead else event.next_attempt_at,
        )
        if dead:
            stats.dead += 1
            logger.error("outbox event is DEAD after %d attempts", event.attempts, extra=extra)
            signals.event_dead.send(sender=OutboxEvent, event=event, error=error)
        elif event.failure_kind == FailureKind.CONFIGURATION:
            stats.failed += 1
            logger.error(
                "outbox publish refused: a configuration error (the route or the broker); "
                "retrying every %g s",
                conf.OUTBOX_BACKOFF_MAX_SECONDS,
                extra=extra,
            )
        else:
            stats.failed += 1
            logger.warning("outbox publish failed; will retry", extra=extra)
    if stats.lost:
        logger.warning(
            "outbox relay lost its lease on %d published events; another relay resends "
            "them with the same event ids",
            stats.lost,
            extra={"outbox_lost": stats.lost},
        )


def _log_extra(event: OutboxEvent, error: BaseException) -> dict[str, Any]:
    return {
        "outbox_event_id": str(event.event_id),
        "outbox_topic": event.topic,
        "outbox_attempts": event.attempts,
        "outbox_error": describe(error),
        "outbox_failure_kind": failure_kind(error).value,
    }
