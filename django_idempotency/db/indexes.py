"""Indexes the app's migrations create beyond those the models' ``Meta.indexes`` declare.

``django_idempotency_created_idx``, on the idempotency records' ``created_at``, bounds the admin
overview's per-hour queries to the last 24 hours (``operations/overview.py``): without it
they would read the whole records table whenever ``TTL_SECONDS`` keeps more than a day of
records, and on PostgreSQL it covers them (they read the index, not the table). Migration 0010
creates it (``CREATE INDEX CONCURRENTLY`` on PostgreSQL, one partition at a time when the
table is partitioned), and the partition machinery (``operations/partitions.py``) carries it
like the model's own indexes when it moves the table to partitions and back.

It is not in ``IdempotencyRecord.Meta.indexes`` (yet): Django's migration state does not know
it, so ``makemigrations`` never proposes it. To move it there, add it to ``Meta.indexes`` with a
migration whose ``SeparateDatabaseAndState`` has the ``AddIndex`` as state only.
"""

from __future__ import annotations

from django.db import models

__all__ = ["EXTRA_INDEXES", "RECORD_CREATED_INDEX", "extra_indexes"]

#: The records by the time they were claimed: the overview's hours. On PostgreSQL it carries
#: the columns the overview groups by, so that counting a day of records reads the index only
#: (other databases ignore ``include``).
RECORD_CREATED_INDEX = models.Index(
    fields=["created_at"],
    include=["status", "response_status", "lease_expires_at", "attempts"],
    name="django_idempotency_created_idx",
)

#: By model name (``Model._meta.model_name``).
EXTRA_INDEXES: dict[str, tuple[models.Index, ...]] = {
    "idempotencyrecord": (RECORD_CREATED_INDEX,),
}


def extra_indexes(model: type[models.Model]) -> tuple[models.Index, ...]:
    """The indexes a model's table has beyond its ``Meta.indexes``."""
    return EXTRA_INDEXES.get(str(model._meta.model_name), ())
