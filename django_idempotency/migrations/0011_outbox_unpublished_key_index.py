"""The unpublished outbox events of each key in id order, a partial index (``db/indexes.py``):
the relay's per-key order check reads a range that ends at its candidate, however deep the key.

PostgreSQL builds it concurrently (per partition on a partitioned outbox, as migration 0010
does), so the migration is not atomic and stops no publish; SQLite at once. MariaDB and MySQL
have no partial indexes: there the check keeps to ``django_idem_outbox_key_idx``. The index
is the database's only: the migration state does not change.
"""

from django.db import migrations

from django_idempotency.db.indexes import OUTBOX_UNPUBLISHED_0011

create_index = OUTBOX_UNPUBLISHED_0011.create
drop_index = OUTBOX_UNPUBLISHED_0011.drop


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_idempotency", "0010_record_created_index"),
    ]

    operations = [
        migrations.RunPython(create_index, drop_index, hints={"model_name": "outboxevent"}),
    ]
