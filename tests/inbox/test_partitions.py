"""The inbox markers table partitioned by day (``INBOX_PARTITIONS``, PostgreSQL only): one
marker per (consumer, message) across a partition boundary the clock really crosses, the
migration both ways under consuming threads, retention, the missing partition, the command and
the task. (``tests/outbox/test_partitions.py`` runs tests/inbox/test_consumers.py again on a
partitioned inbox.)"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from django_idempotency.db import database_now
from django_idempotency.db import postgresql as pg
from django_idempotency.exceptions import PartitionMissing
from django_idempotency.inbox import consume_once
from django_idempotency.models import ProcessedMessage
from django_idempotency.operations import partitions
from django_idempotency.operations.partitions import INBOX
from django_idempotency.operations.sweeps import sweep_processed_messages
from tests.operations.test_partitions import (
    Threads,
    partitioned_layout,
    past_the_legacy_retention,
    wait_until,
)

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="partitions are PostgreSQL's"),
    pytest.mark.django_db(transaction=True),
]

TABLE = ProcessedMessage._meta.db_table
LEGACY = f"{TABLE}{partitions.LEGACY_SUFFIX}"


@pytest.fixture
def partitioned(
    transactional_db: Any, idempotency_settings: Any
) -> Iterator[Callable[..., datetime]]:
    """Call it to partition the inbox table; plain again after the test."""
    yield from partitioned_layout(INBOX, idempotency_settings)


def plant(processed_at: datetime, consumer: str = "billing") -> ProcessedMessage:
    return ProcessedMessage.objects.create(
        consumer=consumer, message_id=str(uuid.uuid4()), processed_at=processed_at
    )


def partitions_of(message_id: str) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT tableoid::regclass::text FROM "{TABLE}" WHERE message_id = %s', [message_id]
        )
        return [str(row[0]).strip('"') for row in cursor.fetchall()]


def handle(message_id: str) -> bool:
    """Consume the message once; whether this call handled it."""
    with consume_once("billing", message_id) as consumption:
        return bool(consumption)


def test_the_migration_keeps_every_marker_and_goes_back(partitioned):
    now = database_now("default")
    planted = [plant(now - timedelta(days=2)) for _ in range(10)]
    before = sorted(ProcessedMessage.objects.values_list("id", "consumer", "message_id"))
    bound = partitioned()
    assert partitions.partitions(layout=INBOX)[0] == partitions.Partition(LEGACY, None, bound)
    assert sorted(ProcessedMessage.objects.values_list("id", "consumer", "message_id")) == before
    assert not handle(planted[0].message_id)  # a duplicate in the legacy partition
    assert handle("new-message")
    partitions.unpartition_table(layout=INBOX)
    assert not partitions.is_partitioned(layout=INBOX)
    assert ProcessedMessage.objects.count() == 11


def race(bound: datetime) -> list[str]:
    """One consumer marks a message before the boundary and stays in its transaction past it;
    three more consume the same message after the boundary. What each did."""
    message_id = f"straddling-{uuid.uuid4()}"
    marked = threading.Event()
    outcomes: list[str] = []

    def first() -> None:
        try:
            with consume_once("billing", message_id) as consumption:
                outcomes.append("handled" if consumption else "duplicate")
                marked.set()
                wait_until(bound + timedelta(seconds=0.3))  # the others consume meanwhile
        finally:
            marked.set()
            connection.close()

    def later() -> None:
        try:
            marked.wait(10)
            wait_until(bound + timedelta(seconds=0.05))
            outcomes.append("handled" if handle(message_id) else "duplicate")
        finally:
            connection.close()

    threads = [threading.Thread(target=first)] + [threading.Thread(target=later) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    outcomes.append(",".join(sorted(partitions_of(message_id))))
    return outcomes


def test_concurrent_consumers_of_one_message_across_the_boundary_handle_it_once(partitioned):
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    *handled, where = race(bound)
    assert sorted(handled) == ["duplicate"] * 3 + ["handled"]
    assert where == LEGACY  # one marker, before the boundary


def test_without_the_message_lock_the_same_race_handles_it_twice(partitioned, monkeypatch):
    monkeypatch.setattr(pg, "INBOX_LOCK_STATEMENT", "SELECT %(consumer)s::text")
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    *handled, where = race(bound)
    assert handled.count("handled") > 1
    assert LEGACY in where.split(",") and len(where.split(",")) == handled.count("handled")
    ProcessedMessage.objects.all().delete()  # moving back would fail on the duplicates


def test_a_message_with_no_partition_for_its_time_fails_and_marks_nothing(partitioned, monkeypatch):
    partitioned(database_now("default") + timedelta(hours=2))
    later = partitions.partitions(layout=INBOX)[-1].end + timedelta(hours=1)
    monkeypatch.setattr(timezone, "now", lambda: later)
    with pytest.raises(PartitionMissing, match="create --table inbox"):
        handle("too-late")
    assert not ProcessedMessage.objects.filter(message_id="too-late").exists()


def test_retention_drops_inbox_partitions_past_the_retention(partitioned, idempotency_settings):
    idempotency_settings(INBOX_RETENTION_SECONDS=86400)
    now = database_now("default")
    plant(now - timedelta(days=3))
    assert sweep_processed_messages(dry_run=True) == 1
    bound = partitioned(now + timedelta(seconds=1))
    assert sweep_processed_messages() == 0  # left to retention
    assert partitions.apply_retention(now=now, layout=INBOX) == []  # not ended yet
    later = past_the_legacy_retention(bound)
    assert partitions.apply_retention(now=later, layout=INBOX) == [
        partitions.RetentionOutcome(LEGACY, "dropped")
    ]
    assert ProcessedMessage.objects.count() == 0


def test_the_command_and_the_task_maintain_the_inbox(partitioned, idempotency_settings):
    from django_idempotency import tasks

    assert "django-idempotency-inbox-partitions" in tasks.BEAT_SCHEDULE
    out = StringIO()
    call_command("idempotency_partitions", "status", "--table", "inbox", stdout=out)
    assert "The inbox table is not partitioned." in out.getvalue()
    call_command(
        "idempotency_partitions", "partition", "--table", "inbox", "--bound", "+2h", stdout=out
    )
    assert "The inbox table is partitioned" in out.getvalue()
    idempotency_settings(PARTITION_AHEAD_DAYS=6)
    result = tasks.maintain_inbox_partitions.apply().get()
    assert result["created"] and result["refused"] == {} and result["dropped"] == []
    out = StringIO()
    call_command("idempotency_partitions", "--table", "inbox", stdout=out)  # maintain
    assert "created 0 partitions" in out.getvalue()
    call_command("idempotency_partitions", "unpartition", "--table", "inbox", stdout=out)
    assert "Turn IDEMPOTENCY['INBOX_PARTITIONS'] off" in out.getvalue()


class Consumers(Threads):
    """Threads consuming new messages (and each one again, a duplicate) until stopped."""

    def __init__(self, count: int = 3) -> None:
        super().__init__(count)
        self.handled: list[str] = []

    def step(self, worker: int, count: int) -> None:
        message_id = f"w{worker}-{count}"
        assert handle(message_id)
        self.handled.append(message_id)
        assert not handle(message_id)

    def check(self) -> None:
        assert self.errors == []
        ids = list(ProcessedMessage.objects.values_list("message_id", flat=True))
        assert sorted(ids) == sorted(self.handled)


def test_the_moves_lose_and_duplicate_no_marker_while_consumers_run(partitioned):
    with Consumers() as consumers:
        time.sleep(0.3)
        partitioned(database_now("default") + timedelta(hours=2))
        during = len(consumers.handled)
        time.sleep(0.3)
        partitions.unpartition_table(layout=INBOX)
        time.sleep(0.3)
    assert 0 < during < len(consumers.handled)
    consumers.check()
    with transaction.atomic():
        assert not partitions.is_partitioned(layout=INBOX)
