"""Instances built from hand-written SQL (``db.rows.from_rows``, what the relay's claim uses) equal
the ORM's, and a project that listens to the model's init signals still hears them."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.models.signals import post_init, pre_init

from django_idempotency.db import rows
from django_idempotency.models import OutboxEvent
from tests.support.outbox_support import publish_committed

pytestmark = pytest.mark.django_db(transaction=True)


def raw_rows() -> list[tuple[Any, ...]]:
    """Every outbox row as the driver returns it: JSON in text, SQLite's timestamps in text."""
    columns = ", ".join(
        rows.quoted_column(connection, OutboxEvent, field)
        for field in rows.concrete_fields(OutboxEvent)
    )
    table = rows.quoted_table(connection, OutboxEvent)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {columns} FROM {table} ORDER BY id")
        return list(cursor.fetchall())


def state(instance: OutboxEvent) -> tuple[dict[str, Any], bool, str | None]:
    fields = {name: value for name, value in vars(instance).items() if name != "_state"}
    return fields, instance._state.adding, instance._state.db


def test_an_instance_built_from_a_row_equals_the_orms():
    publish_committed(payload={"total": "19.99", "items": [1, 2]}, key="k")
    publish_committed(payload=None, key="k", headers={"trace": "t"})
    built = rows.from_rows(OutboxEvent, "default", raw_rows())
    read = list(OutboxEvent.objects.order_by("id"))
    assert [state(instance) for instance in built] == [state(instance) for instance in read]
    assert built[0].payload == {"total": "19.99", "items": [1, 2]}  # converted, not text
    built[0].topic = "orders.changed"
    built[0].save(update_fields=["topic"])  # an instance read from the database: an UPDATE
    assert OutboxEvent.objects.get(pk=built[0].pk).topic == "orders.changed"
    assert OutboxEvent.objects.count() == 2


@pytest.mark.parametrize("signal", [pre_init, post_init], ids=["pre_init", "post_init"])
def test_a_receiver_of_the_init_signals_hears_each_instance(signal):
    publish_committed(key="k")
    publish_committed(key="k")
    heard: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        heard.append(kwargs.get("instance", kwargs.get("args")))

    signal.connect(receiver, sender=OutboxEvent)
    try:
        built = rows.from_rows(OutboxEvent, "default", raw_rows())
    finally:
        signal.disconnect(receiver, sender=OutboxEvent)
    assert len(heard) == 2
    if signal is post_init:
        assert heard == built
    assert [state(instance) for instance in built] == [
        state(instance) for instance in OutboxEvent.objects.order_by("id")
    ]
