"""On PostgreSQL the outbox's pages keep room for the version each claim writes, so the claim's
update is HOT and adds no index entries (``db.postgresql.OUTBOX_FILLFACTOR``).

Set on the table, or on each partition of a partitioned outbox (new partitions are created with
it). Existing pages are not rewritten: the setting applies to pages filled from now on, and no
lock stops reads or writes while it is set. Other databases have no such setting.
"""

from django.db import migrations

from django_idempotency.db.postgresql import OUTBOX_FILLFACTOR

#: The outbox itself when it is a plain table, else each of its partitions.
TABLES = """
    SELECT c.oid::regclass::text FROM pg_class c
    WHERE c.oid = to_regclass(%(table)s) AND c.relkind = 'r'
    UNION ALL
    SELECT i.inhrelid::regclass::text FROM pg_inherits i WHERE i.inhparent = to_regclass(%(table)s)
"""


def _set(storage: str):
    def operation(apps, schema_editor):
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            return
        table = apps.get_model("django_idempotency", "OutboxEvent")._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(TABLES, {"table": connection.ops.quote_name(table)})
            for (name,) in cursor.fetchall():
                cursor.execute(f"ALTER TABLE {name} {storage}")

    return operation


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0012_outbox_held_status"),
    ]

    operations = [
        migrations.RunPython(
            _set(f"SET (fillfactor = {OUTBOX_FILLFACTOR})"),
            _set("RESET (fillfactor)"),
            hints={"model_name": "outboxevent"},
        ),
    ]
