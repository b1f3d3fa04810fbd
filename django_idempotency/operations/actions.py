"""State changes an operator makes on idempotency records. The admin's actions call these; so
can commands and tests.

Each works through the selection in batches, one short transaction per batch, and judges every
row again under a row lock before it changes anything: the page an operator acted on may be
minutes old, and a request may have taken the row since. The outbox's own actions live in
:mod:`django_idempotency.outbox.operator`.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet

from django_idempotency import signals
from django_idempotency.core import leases
from django_idempotency.db import database_now
from django_idempotency.db.batches import Row, locked_batches
from django_idempotency.models import IdempotencyRecord

__all__ = ["RELEASE_BATCH_SIZE", "ReleaseResult", "release_records"]

#: Rows locked and changed per transaction, so acting on "all 200,000 stuck keys" never holds
#: one long transaction or a lock on every row at once.
RELEASE_BATCH_SIZE = 500


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    #: Records deleted; ``key_released`` was sent for each.
    released: int = 0
    #: Records left alone because a request's lease on them is still running.
    refused: int = 0


def release_records(
    queryset: QuerySet[IdempotencyRecord],
    *,
    force: bool = False,
    reason: str = "admin",
    batch_size: int = RELEASE_BATCH_SIZE,
) -> ReleaseResult:
    """Delete the selected records so their keys can be used again.

    Stuck (PROCESSING, lease expired) and COMPLETED records are released. A record whose lease
    is still running belongs to a request that may still be working on it: it is refused unless
    ``force``. Forcing never lets work happen twice: that request's completion finds no record
    (the fencing token check), rolls its writes back and answers 409; the client's retry then
    runs once. Releasing a COMPLETED record, by contrast, means the client's next retry runs the
    request again: that is what an operator asks for when the stored response was wrong.

    Each released record is announced with ``key_released`` (``reason="admin"`` by default)
    after its batch commits, which is when the Redis fast path deletes its own entry.
    """

    def release(using: str, rows: list[Row]) -> tuple[list[Row], int]:
        # Judged as the row is now, not as the admin page showed it: a stuck key may have been
        # taken over by a retry since, and is then running again.
        now = database_now(using)  # leases are the database's, whatever this machine's clock says
        chosen = [row for row in rows if force or not leases.running(row[3], row[4], now)]
        IdempotencyRecord.objects.using(using).filter(pk__in=[row[0] for row in chosen]).delete()
        return chosen, len(rows) - len(chosen)

    released = refused = 0
    fields = ("scope", "key", "status", "lease_expires_at")
    for chosen, left in locked_batches(queryset, fields, batch_size, release):
        released += len(chosen)
        refused += left
        for _pk, scope, key, _status, _lease in chosen:
            signals.key_released.send(sender=IdempotencyRecord, scope=scope, key=key, reason=reason)
    return ReleaseResult(released=released, refused=refused)
