"""On PostgreSQL the outbox table is vacuumed after every 10,000 changes, not after a fraction of
a table that may be nearly empty (``db.postgresql.OUTBOX_AUTOVACUUM``).

Set on the table, or on each partition of a partitioned outbox (new partitions are created with
it). Nothing is rewritten and no lock stops reads or writes. A project that wants other
thresholds sets them after this migration (on each partition; partitions created later get
these). Other databases have no such settings.
"""

from django.db import migrations

from django_idempotency.db.postgresql import (
    OUTBOX_AUTOVACUUM,
    alter_outbox_storage,
    storage_parameters,
)


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0013_outbox_fillfactor"),
    ]

    operations = [
        migrations.RunPython(
            alter_outbox_storage(f"SET ({storage_parameters(OUTBOX_AUTOVACUUM)})"),
            alter_outbox_storage(f"RESET ({', '.join(OUTBOX_AUTOVACUUM)})"),
            hints={"model_name": "outboxevent"},
        ),
    ]
