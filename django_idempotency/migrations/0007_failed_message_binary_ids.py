from django.db import migrations


def binary_failed_message_collation(apps, schema_editor):
    """Compare the failure records' consumer names and message ids byte for byte on MySQL and
    MariaDB, as 0002 made the inbox markers'.

    Under their default collations 'abc' equals 'ABC' (and 'abc '), so two different messages
    would share one failure record, and handling one would delete the other's.
    """
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
    table = schema_editor.quote_name("django_idempotency_failedmessage")
    columns = ", ".join(
        f"MODIFY {schema_editor.quote_name(column)} "
        f"varchar(255) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
        for column in ("consumer", "message_id")
    )
    schema_editor.execute(f"ALTER TABLE {table} {columns}")


class Migration(migrations.Migration):

    dependencies = [
        ("django_idempotency", "0006_record_accepted_status"),
    ]

    operations = [
        migrations.RunPython(
            binary_failed_message_collation, migrations.RunPython.noop, atomic=False
        ),
    ]
