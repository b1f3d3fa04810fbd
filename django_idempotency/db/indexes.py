"""Indexes the app's migrations create beyond those the models' ``Meta.indexes`` declare, and
how the migrations build them.

* ``django_idempotency_created_idx``, on the idempotency records' ``created_at``, bounds the
  admin overview's per-hour queries to the last 24 hours (``operations/overview.py``): without
  it they would read the whole records table whenever ``TTL_SECONDS`` keeps more than a day of
  records, and on PostgreSQL it covers them (they read the index, not the table). Migration 0010.
* ``django_idem_outbox_unpub_idx``, the unpublished outbox events of each key in id order
  (partial): the relay's per-key order check reads a range that ends at its candidate, however
  deep the key (``db.querysets.earlier_unpublished``). Migration 0011, on PostgreSQL and SQLite;
  MariaDB and MySQL have no partial indexes and keep to ``django_idem_outbox_key_idx``.

Neither is in ``Meta.indexes``: Django's migration state does not know them, so
``makemigrations`` never proposes them, and MariaDB projects get no warning about a condition
they cannot have. On PostgreSQL they are built with ``CREATE INDEX CONCURRENTLY`` (one
partition at a time when the table is partitioned), so building them stops no claim and no
publish; the partition machinery (``operations/partitions.py``) carries them like the model's
own indexes when it moves a table to partitions and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import models

__all__ = [
    "EXTRA_INDEXES",
    "OUTBOX_UNPUBLISHED",
    "OUTBOX_UNPUBLISHED_0011",
    "OUTBOX_UNPUBLISHED_INDEX",
    "RECORD_CREATED",
    "RECORD_CREATED_INDEX",
    "Built",
    "extra_indexes",
]

#: The records by the time they were claimed: the overview's hours. On PostgreSQL it carries
#: the columns the overview groups by, so that counting a day of records reads the index only
#: (other databases ignore ``include``).
RECORD_CREATED_INDEX = models.Index(
    fields=["created_at"],
    include=["status", "response_status", "lease_expires_at", "attempts"],
    name="django_idempotency_created_idx",
)

#: The unpublished events of a key, in id order (relay order among unpublished events).
OUTBOX_UNPUBLISHED_INDEX = models.Index(
    fields=["key", "id"],
    condition=models.Q(status__in=["PENDING", "DEAD", "HELD"]),
    name="django_idem_outbox_unsent_idx",
)

#: By model name (``Model._meta.model_name``).
EXTRA_INDEXES: dict[str, tuple[models.Index, ...]] = {
    "idempotencyrecord": (RECORD_CREATED_INDEX,),
    "outboxevent": (OUTBOX_UNPUBLISHED_INDEX,),
}


def extra_indexes(model: type[models.Model]) -> tuple[models.Index, ...]:
    """The indexes a model's table has beyond its ``Meta.indexes``."""
    return EXTRA_INDEXES.get(str(model._meta.model_name), ())


@dataclass(frozen=True, slots=True)
class Built:
    """How a migration builds one of these indexes: the model (by name), the index, what follows
    ``ON <table>`` on PostgreSQL, and the suffix of each partition's own index's name."""

    model_name: str
    index: models.Index
    definition: str
    partition_suffix: str

    def create(self, apps: Any, schema_editor: Any) -> None:
        model = self._model(apps, schema_editor)
        if model is None:
            return
        vendor = schema_editor.connection.vendor
        if vendor == "postgresql":
            self._create_on_postgresql(schema_editor, model._meta.db_table)
        elif (
            self.index.condition is None
            or schema_editor.connection.features.supports_partial_indexes
        ):
            schema_editor.add_index(model, self.index)

    def drop(self, apps: Any, schema_editor: Any) -> None:
        model = self._model(apps, schema_editor)
        if model is None:
            return
        if schema_editor.connection.vendor == "postgresql":
            # Also the partitions' indexes, when the table is partitioned.
            name = schema_editor.quote_name(self.index.name)
            schema_editor.execute(f"DROP INDEX IF EXISTS {name}")
        elif (
            self.index.condition is None
            or schema_editor.connection.features.supports_partial_indexes
        ):
            schema_editor.remove_index(model, self.index)

    def _model(self, apps: Any, schema_editor: Any) -> Any:
        """The model, or None where this database has no table for it."""
        model = apps.get_model("django_idempotency", self.model_name)
        if model._meta.db_table not in schema_editor.connection.introspection.table_names():
            return None
        return model

    def _create_on_postgresql(self, schema_editor: Any, table: str) -> None:
        quote = schema_editor.quote_name
        name = str(self.index.name)
        with schema_editor.connection.cursor() as cursor:
            # A concurrent build that failed leaves an invalid index: built again.
            cursor.execute(
                "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE c.relname = %s",
                [name],
            )
            row = cursor.fetchone()
            if row is not None and row[0]:
                return
            cursor.execute(
                "SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [quote(table)]
            )
            partitioned = cursor.fetchone()[0] == "p"
            if not partitioned:
                if row is not None:
                    cursor.execute(f"DROP INDEX CONCURRENTLY {quote(name)}")
                cursor.execute(
                    f"CREATE INDEX CONCURRENTLY {quote(name)} ON {quote(table)} {self.definition}"
                )
                return
            cursor.execute(
                f"CREATE INDEX IF NOT EXISTS {quote(name)} ON ONLY {quote(table)} {self.definition}"
            )
            cursor.execute(
                "SELECT child.relname FROM pg_inherits JOIN pg_class child "
                "ON child.oid = pg_inherits.inhrelid WHERE pg_inherits.inhparent = "
                "to_regclass(%s)",
                [quote(table)],
            )
            for (partition,) in cursor.fetchall():
                child = f"{partition}_{self.partition_suffix}"
                cursor.execute(
                    "SELECT 1 FROM pg_inherits WHERE inhparent = to_regclass(%s) "
                    "AND inhrelid = to_regclass(%s)",
                    [quote(name), quote(child)],
                )
                if cursor.fetchone() is not None:
                    continue
                cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(child)}")
                cursor.execute(
                    f"CREATE INDEX CONCURRENTLY {quote(child)} ON {quote(partition)} "
                    f"{self.definition}"
                )
                cursor.execute(f"ALTER INDEX {quote(name)} ATTACH PARTITION {quote(child)}")


#: Migration 0010's index.
RECORD_CREATED = Built(
    "IdempotencyRecord",
    RECORD_CREATED_INDEX,
    "(created_at) INCLUDE (status, response_status, lease_expires_at, attempts)",
    "created_idx",
)
#: Migration 0011's index, replaced by migration 0012's when HELD events joined the unpublished.
OUTBOX_UNPUBLISHED_0011 = Built(
    "OutboxEvent",
    models.Index(
        fields=["key", "id"],
        condition=models.Q(status__in=["PENDING", "DEAD"]),
        name="django_idem_outbox_unpub_idx",
    ),
    "(key, id) WHERE status IN ('PENDING', 'DEAD')",
    "unpub_idx",
)
#: Migration 0012's index.
OUTBOX_UNPUBLISHED = Built(
    "OutboxEvent",
    OUTBOX_UNPUBLISHED_INDEX,
    "(key, id) WHERE status IN ('PENDING', 'DEAD', 'HELD')",
    "unsent_idx",
)
