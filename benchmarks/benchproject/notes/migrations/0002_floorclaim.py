from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("bench_notes", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="FloorClaim",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("key", models.CharField(max_length=255, unique=True)),
                ("status", models.PositiveSmallIntegerField(null=True)),
                ("body", models.BinaryField(null=True)),
            ],
        ),
    ]
