"""The unpublished events of each key in id order (PostgreSQL and SQLite; MariaDB and MySQL have
no partial indexes and keep to ``django_idem_outbox_key_idx``): the relay's per-key order
check reads a range that ends at the candidate, however deep the key (see
``db.querysets.earlier_unpublished``)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0010_record_created_index"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="outboxevent",
            index=models.Index(
                condition=models.Q(status__in=["PENDING", "DEAD"]),
                fields=["key", "id"],
                name="django_idem_outbox_unpub_idx",
            ),
        ),
    ]
