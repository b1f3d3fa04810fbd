"""On PostgreSQL the outbox's pages keep room for the version each claim writes, so the claim's
update is HOT and adds no index entries (``db.postgresql.OUTBOX_FILLFACTOR``).

Set on the table, or on each partition of a partitioned outbox (new partitions are created with
it). Existing pages are not rewritten: the setting applies to pages filled from now on, and no
lock stops reads or writes while it is set. Other databases have no such setting.
"""

from django.db import migrations

from django_idempotency.db.postgresql import OUTBOX_FILLFACTOR, alter_outbox_storage


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0012_outbox_held_status"),
    ]

    operations = [
        migrations.RunPython(
            alter_outbox_storage(f"SET (fillfactor = {OUTBOX_FILLFACTOR})"),
            alter_outbox_storage("RESET (fillfactor)"),
            hints={"model_name": "outboxevent"},
        ),
    ]
