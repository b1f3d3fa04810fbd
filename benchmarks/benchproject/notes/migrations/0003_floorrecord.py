from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("bench_notes", "0002_floorclaim")]

    operations = [
        migrations.CreateModel(
            name="FloorRecord",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("scope", models.CharField(max_length=64)),
                ("key", models.CharField(max_length=255)),
                ("expires_at", models.DateTimeField()),
                ("status", models.PositiveSmallIntegerField()),
                ("body", models.BinaryField()),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("scope", "key"), name="bench_floorrecord_scope_key")
                ],
            },
        ),
    ]
