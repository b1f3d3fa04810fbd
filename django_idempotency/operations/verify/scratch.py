"""A run's scratch data: the names it writes under, the effects it counts, and its clean-up.

Every scope, consumer, key and topic a run writes starts with :data:`PREFIX` and the run's id,
so nothing of the project is ever read or written, and :func:`clean_up` finds everything the
run left (and what an interrupted run left more than an hour ago).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.db import router
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.request import redis_copy

__all__ = ["PATH", "PREFIX", "Scratch", "clean_up"]

#: Every scratch scope, consumer, key and topic starts with this.
PREFIX = "idempotency-verify"
#: The path of every scratch request.
PATH = "/idempotency-verify/"
#: Leftovers of an interrupted run older than this are swept at the next run.
_LEFTOVER_AGE = timedelta(hours=1)


class Scratch:
    """This run's names, and the bookkeeping to delete everything it wrote."""

    def __init__(self) -> None:
        self.run = uuid.uuid4().hex[:12]
        self.scope = f"{PREFIX}:{self.run}"
        self.topic = f"{PREFIX}.{self.run}"
        self.event_ids: set[int] = set()

    def key(self, name: str) -> str:
        return f"{PREFIX}-{self.run}-{name}"

    def effects(self, name: str) -> int:
        """Scratch markers the views wrote for ``name``: how many times a view really ran."""
        return (
            ProcessedMessage.objects.using(router.db_for_write(ProcessedMessage))
            .filter(consumer=self.scope, message_id__startswith=f"{name}:")
            .count()
        )

    def effect(self, name: str) -> None:
        """What a scratch view does: one row, written in the view's transaction."""
        ProcessedMessage.objects.using(router.db_for_write(ProcessedMessage)).create(
            consumer=self.scope, message_id=f"{name}:{uuid.uuid4()}", processed_at=timezone.now()
        )


def clean_up(scratch: Scratch) -> None:
    """Delete this run's scratch rows and Redis copies, and leftovers of interrupted runs."""
    cutoff = timezone.now() - _LEFTOVER_AGE
    records = IdempotencyRecord.objects.using(router.db_for_write(IdempotencyRecord))
    mine = records.filter(scope=scratch.scope) | records.filter(
        key__startswith=f"{PREFIX}-{scratch.run}-"
    )
    old = records.filter(scope__startswith=f"{PREFIX}:", created_at__lt=cutoff)
    for queryset in (mine, old):
        for scope, key in list(queryset.values_list("scope", "key")):
            redis_copy.forget(scope, key)
        queryset.delete()
    messages = ProcessedMessage.objects.using(router.db_for_write(ProcessedMessage))
    messages.filter(consumer=scratch.scope).delete()
    messages.filter(consumer__startswith=f"{PREFIX}:", processed_at__lt=cutoff).delete()
    events = OutboxEvent.objects.using(router.db_for_write(OutboxEvent))
    events.filter(pk__in=scratch.event_ids).delete()
    events.filter(topic__startswith=f"{PREFIX}.", created_at__lt=cutoff).delete()
