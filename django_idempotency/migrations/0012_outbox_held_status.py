"""Outbox events can be HELD: set aside behind a failed earlier event of their key, so the
relay's claim no longer reads them (see ``outbox/holding.py``).

The partial index of unpublished events by key now covers HELD events too: a new index is built
(concurrently on PostgreSQL, per partition on a partitioned outbox), then migration 0011's is
dropped, so the order check is served throughout and no publish stops. Going back, HELD events
become PENDING again before the old index returns.
"""

from django.db import migrations, models

from django_idempotency.db.indexes import OUTBOX_UNPUBLISHED, OUTBOX_UNPUBLISHED_0011

create_index = OUTBOX_UNPUBLISHED.create
drop_index = OUTBOX_UNPUBLISHED.drop


def release_held(apps, schema_editor):
    OutboxEvent = apps.get_model("django_idempotency", "OutboxEvent")
    OutboxEvent.objects.using(schema_editor.connection.alias).filter(status="HELD").update(
        status="PENDING"
    )


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_idempotency", "0011_outbox_unpublished_key_index"),
    ]

    operations = [
        migrations.AlterField(
            model_name="outboxevent",
            name="status",
            field=models.CharField(
                choices=[
                    ("PENDING", "Pending"),
                    ("PUBLISHED", "Published"),
                    ("DEAD", "Dead"),
                    ("HELD", "Held (behind a failed event of its key)"),
                ],
                default="PENDING",
                help_text=(
                    "PENDING until published; DEAD after OUTBOX_MAX_ATTEMPTS failures, until "
                    "retried; HELD while an earlier event of its key is DEAD or waits for a retry."
                ),
                max_length=16,
                verbose_name="status",
            ),
        ),
        migrations.RunPython(create_index, drop_index, hints={"model_name": "outboxevent"}),
        migrations.RunPython(
            OUTBOX_UNPUBLISHED_0011.drop,
            OUTBOX_UNPUBLISHED_0011.create,
            hints={"model_name": "outboxevent"},
        ),
        migrations.RunPython(migrations.RunPython.noop, release_held),
    ]
