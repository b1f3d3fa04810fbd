from django.db import migrations, models


def classify_failed_events(apps, schema_editor):
    """Events that failed before kinds were recorded get theirs from ``last_error``, whose text
    starts with the exception's type (the relay records the kind from the exception itself).

    Failed events are few (the status index finds them); they are updated in batches.
    """
    from django.db.models import Q

    OutboxEvent = apps.get_model("django_idempotency", "OutboxEvent")
    failed = (
        OutboxEvent.objects.using(schema_editor.connection.alias)
        .filter(Q(status="DEAD") | Q(status="PENDING", attempts__gt=0))
        .filter(failure_kind=None)
        .exclude(last_error="")
    )
    kinds = {
        "BrokerUnavailable": "unreachable",
        "UnroutableTopic": "configuration",
        "IdempotencyConfigurationError": "configuration",
    }
    last_pk = 0
    while True:
        batch = list(
            failed.filter(pk__gt=last_pk).order_by("pk").values_list("pk", "last_error")[:1000]
        )
        if not batch:
            return
        groups = {}
        for pk, error in batch:
            groups.setdefault(kinds.get(error.partition(":")[0], "other"), []).append(pk)
        for kind, pks in groups.items():
            failed.filter(pk__in=pks).update(failure_kind=kind)
        last_pk = batch[-1][0]


class Migration(migrations.Migration):

    dependencies = [
        ('django_idempotency', '0007_failed_message_binary_ids'),
    ]

    operations = [
        migrations.AddField(
            model_name='outboxevent',
            name='failure_kind',
            field=models.CharField(blank=True, choices=[('unreachable', 'Unreachable'), ('configuration', 'Configuration'), ('other', 'Other')], help_text='Why the latest attempt failed: unreachable (the broker could not be reached), configuration (the broker refused the route: credentials, permissions, a missing stream or exchange; retried only every OUTBOX_BACKOFF_MAX_SECONDS, never DEAD for it) or other. Empty once published or retried.', max_length=16, null=True, verbose_name='failure kind'),
        ),
        migrations.RunPython(classify_failed_events, migrations.RunPython.noop),
    ]
