from django.db import migrations, models


class Migration(migrations.Migration):
    """The floors store the request's fingerprint, and the first-time floor's claim its scope.
    The rows already there are the benchmark's own, seeded or claimed again by every run."""

    dependencies = [("bench_notes", "0003_floorrecord")]

    operations = [
        migrations.RunSQL(
            "DELETE FROM bench_notes_floorrecord; DELETE FROM bench_notes_floorclaim;",
            migrations.RunSQL.noop,
        ),
        migrations.AddField(
            model_name="floorrecord",
            name="fingerprint",
            field=models.BinaryField(default=b""),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name="floorclaim",
            name="key",
            field=models.CharField(max_length=255),
        ),
        migrations.AddField(
            model_name="floorclaim",
            name="scope",
            field=models.CharField(default="", max_length=64),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="floorclaim",
            name="fingerprint",
            field=models.BinaryField(default=b""),
            preserve_default=False,
        ),
        migrations.AddConstraint(
            model_name="floorclaim",
            constraint=models.UniqueConstraint(
                fields=("scope", "key"), name="bench_floorclaim_scope_key"
            ),
        ),
    ]
