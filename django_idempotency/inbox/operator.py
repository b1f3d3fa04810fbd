"""What an operator does with the record of a failed message: forget it.

The message itself lives in the broker, which redelivers it (a Celery retry, a late ack after a
worker died, a dead-letter queue's shovel); a record only says why handling it failed, and the
handler deletes it when it finally succeeds. Forgetting records clears a failure group the
operator has dealt with; a message that fails again is recorded again.
"""

from __future__ import annotations

import logging

from django.db.models import QuerySet

from django_idempotency import signals
from django_idempotency.db.batches import Row, locked_batches
from django_idempotency.models import FailedMessage

__all__ = ["FORGET_BATCH_SIZE", "forget_failed_messages"]

logger = logging.getLogger(__name__)

#: Records locked and deleted per transaction.
FORGET_BATCH_SIZE = 500


def forget_failed_messages(
    queryset: QuerySet[FailedMessage],
    *,
    batch_size: int = FORGET_BATCH_SIZE,
    failure_group: str | None = None,
) -> int:
    """Delete the selected records of failed messages, in locked batches; returns how many.

    ``failure_group`` (a fingerprint) only labels the signal and the log line: pass it when the
    selection is a failure group. ``failures_forgotten`` is sent once the last batch committed.
    """

    def forget(using: str, rows: list[Row]) -> int:
        deleted, _ = FailedMessage.objects.using(using).filter(pk__in=[r[0] for r in rows]).delete()
        return deleted

    forgotten = sum(locked_batches(queryset, (), batch_size, forget))
    if forgotten:
        logger.info(
            "inbox: %d failed messages forgotten",
            forgotten,
            extra={"inbox_count": forgotten, "inbox_failure_group": failure_group},
        )
    signals.failures_forgotten.send(
        sender=FailedMessage, count=forgotten, failure_group=failure_group
    )
    return forgotten
