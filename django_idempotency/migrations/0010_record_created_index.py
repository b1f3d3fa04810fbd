"""The records' ``created_at`` index, for the admin overview's hours (``db/indexes.py``).

Built without stopping claims: ``CREATE INDEX CONCURRENTLY`` on PostgreSQL (so the migration is
not atomic), and on a table partitioned by day (``RECORD_PARTITIONS``) an index on the parent
only, then one built concurrently on each partition and attached to it; the parent's index is
valid once every partition's is attached, and partitions created later get theirs from it.
MariaDB and MySQL build it online (InnoDB), SQLite at once. The index is the database's only:
the migration state does not change.
"""

from django.db import migrations

from django_idempotency.db.indexes import RECORD_CREATED

create_index = RECORD_CREATED.create
drop_index = RECORD_CREATED.drop


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_idempotency", "0009_failure_columns"),
    ]

    operations = [
        migrations.RunPython(create_index, drop_index, hints={"model_name": "idempotencyrecord"}),
    ]
