"""The records' ``created_at`` index, for the admin overview's hours (``db/indexes.py``).

Built without stopping claims: ``CREATE INDEX CONCURRENTLY`` on PostgreSQL (so the migration is
not atomic), and on a table partitioned by day (``RECORD_PARTITIONS``) an index on the parent
only, then one built concurrently on each partition and attached to it; the parent's index is
valid once every partition's is attached, and partitions created later get theirs from it.
MariaDB and MySQL build it online (InnoDB), SQLite at once. The index is the database's only:
the migration state does not change.
"""

from django.db import migrations, models

NAME = "django_idempotency_created_idx"
INCLUDE = ["status", "response_status", "lease_expires_at", "attempts"]
INDEX = models.Index(fields=["created_at"], include=INCLUDE, name=NAME)
#: On PostgreSQL the index covers the overview's queries (other databases ignore INCLUDE).
COLUMNS = f"(created_at) INCLUDE ({', '.join(INCLUDE)})"


def _postgresql(schema_editor, table):
    quote = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        # A concurrent build that failed leaves an invalid index: built again.
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = %s",
            [NAME],
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            return
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [quote(table)])
        partitioned = cursor.fetchone()[0] == "p"
        if not partitioned:
            if row is not None:
                cursor.execute(f"DROP INDEX CONCURRENTLY {quote(NAME)}")
            cursor.execute(f"CREATE INDEX CONCURRENTLY {quote(NAME)} ON {quote(table)} {COLUMNS}")
            return
        cursor.execute(
            f"CREATE INDEX IF NOT EXISTS {quote(NAME)} ON ONLY {quote(table)} {COLUMNS}"
        )
        cursor.execute(
            "SELECT child.relname FROM pg_inherits JOIN pg_class child "
            "ON child.oid = pg_inherits.inhrelid WHERE pg_inherits.inhparent = to_regclass(%s)",
            [quote(table)],
        )
        for (partition,) in cursor.fetchall():
            child = f"{partition}_created_idx"
            cursor.execute(
                "SELECT 1 FROM pg_inherits WHERE inhparent = to_regclass(%s) "
                "AND inhrelid = to_regclass(%s)",
                [quote(NAME), quote(child)],
            )
            if cursor.fetchone() is not None:
                continue
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(child)}")
            cursor.execute(
                f"CREATE INDEX CONCURRENTLY {quote(child)} ON {quote(partition)} {COLUMNS}"
            )
            cursor.execute(f"ALTER INDEX {quote(NAME)} ATTACH PARTITION {quote(child)}")


def _table(apps, schema_editor):
    """The records' model, or None where this database has no records table."""
    model = apps.get_model("django_idempotency", "IdempotencyRecord")
    if model._meta.db_table not in schema_editor.connection.introspection.table_names():
        return None
    return model


def create_index(apps, schema_editor):
    model = _table(apps, schema_editor)
    if model is None:
        return
    if schema_editor.connection.vendor == "postgresql":
        _postgresql(schema_editor, model._meta.db_table)
    else:
        schema_editor.add_index(model, INDEX)


def drop_index(apps, schema_editor):
    model = _table(apps, schema_editor)
    if model is None:
        return
    if schema_editor.connection.vendor == "postgresql":
        # Also the partitions' indexes, when the table is partitioned.
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(NAME)}")
    else:
        schema_editor.remove_index(model, INDEX)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_idempotency", "0009_failure_columns"),
    ]

    operations = [
        migrations.RunPython(
            create_index, drop_index, hints={"model_name": "idempotencyrecord"}
        ),
    ]
