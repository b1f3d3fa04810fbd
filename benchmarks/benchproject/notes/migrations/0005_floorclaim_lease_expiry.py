from django.db import migrations, models


class Migration(migrations.Migration):
    """The first-time floor's claim holds what a correct claim must: its owner, the end of its
    lease and the record's expiry (indexed, for the sweep). The rows already there are the
    benchmark's own, claimed again by every run."""

    dependencies = [("bench_notes", "0004_floor_scope_fingerprint")]

    operations = [
        migrations.RunSQL("DELETE FROM bench_notes_floorclaim;", migrations.RunSQL.noop),
        migrations.AddField(
            model_name="floorclaim",
            name="owner",
            field=models.UUIDField(default="00000000-0000-0000-0000-000000000000"),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="floorclaim",
            name="lease_expires_at",
            field=models.DateTimeField(default="2000-01-01T00:00:00Z"),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="floorclaim",
            name="expires_at",
            field=models.DateTimeField(db_index=True, default="2000-01-01T00:00:00Z"),
            preserve_default=False,
        ),
    ]
