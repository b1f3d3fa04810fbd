"""The outbox events table partitioned by day (``OUTBOX_PARTITIONS``, PostgreSQL only): the
migration both ways under publishing threads, a given event id unique across a partition
boundary the clock really crosses, retention that drops only what the sweep would delete, the
missing partition, the command and the task; and the relay's own tests, run again on the
partitioned table.

As in tests/operations/test_partitions.py, each test moves the shared test database's plain table to
the partitioned layout with the migration itself and back in a fixture, whatever happens.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone

from django_idempotency.db import database_now
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.exceptions import DuplicateEventId, PartitionMissing
from django_idempotency.models import OutboxEvent
from django_idempotency.operations import partitions
from django_idempotency.operations.partitions import OUTBOX
from django_idempotency.operations.sweeps import sweep_published_events
from django_idempotency.outbox import publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.operations.test_partitions import (
    Threads,
    partitioned_layout,
    past_the_legacy_retention,
    wait_until,
)
from tests.support.outbox_support import REPO_ROOT, publish_committed

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="partitions are PostgreSQL's"),
    pytest.mark.django_db(transaction=True),
]

TABLE = OutboxEvent._meta.db_table
LEGACY = f"{TABLE}{partitions.LEGACY_SUFFIX}"


@pytest.fixture
def partitioned(
    transactional_db: Any, idempotency_settings: Any
) -> Iterator[Callable[..., datetime]]:
    """Call it to partition the outbox table; plain again after the test."""
    broker.clear()
    yield from partitioned_layout(OUTBOX, idempotency_settings)
    broker.clear()


def plant(
    status: str = OutboxStatus.PUBLISHED,
    *,
    created_at: datetime,
    published_at: datetime | None = None,
    key: str = "",
) -> OutboxEvent:
    return OutboxEvent.objects.create(
        topic="orders.paid", key=key, payload={"n": 1}, status=status, created_at=created_at,
        next_attempt_at=created_at,
        published_at=published_at if status == OutboxStatus.PUBLISHED else None,
    )  # fmt: skip


def partition_of(event: OutboxEvent) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT tableoid::regclass::text FROM "{TABLE}" WHERE id = %s', [event.pk])
        return str(cursor.fetchone()[0]).strip('"')


# --- the layout --------------------------------------------------------------------------------


def test_the_migration_keeps_every_event_and_goes_back(partitioned):
    now = database_now("default")
    for n in range(20):
        plant(OutboxStatus.PENDING if n % 2 else OutboxStatus.PUBLISHED,
              created_at=now - timedelta(days=2), published_at=now)  # fmt: skip
    before = sorted(OutboxEvent.objects.values_list("id", "event_id", "status"))
    bound = partitioned()
    assert partitions.is_partitioned(layout=OUTBOX)
    assert not partitions.is_partitioned(layout=partitions.RECORDS)
    parts = partitions.partitions(layout=OUTBOX)
    assert parts[0] == partitions.Partition(LEGACY, None, bound)
    assert all(part.name.startswith(f"{TABLE}_p") for part in parts[1:])
    assert sorted(OutboxEvent.objects.values_list("id", "event_id", "status")) == before
    event = publish_committed()
    assert event.pk > max(row[0] for row in before)  # the identity went on
    assert partition_of(event) == LEGACY  # the bound is an hour or more away
    partitions.unpartition_table(layout=OUTBOX)
    assert not partitions.is_partitioned(layout=OUTBOX)
    assert OutboxEvent.objects.count() == 21
    with pytest.raises(DuplicateEventId):  # the plain table's unique constraint is back
        publish_committed(event_id=event.event_id)


def unpublished_index() -> tuple[str, str]:
    """The kind (``I``: partitioned, ``i``: plain) and definition of the index of unpublished
    events by key (migration 0012)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relkind, pg_get_indexdef(c.oid) FROM pg_class c WHERE c.relname = %s",
            ["django_idem_outbox_unsent_idx"],
        )
        kind, definition = cursor.fetchone()
    return kind, definition


def test_the_partial_index_of_unpublished_events_keeps_its_condition_through_the_moves(
    partitioned,
):
    import importlib

    from django.apps import apps

    migration = importlib.import_module("django_idempotency.migrations.0012_outbox_held_status")
    condition = (
        "WHERE ((status)::text = ANY ((ARRAY['PENDING'::character varying, 'DEAD'::character "
        "varying, 'HELD'::"
    )
    for expected_kind, move in (("I", partitioned), ("i", partitions.unpartition_table)):
        if move is partitioned:
            move()
        else:
            move(layout=OUTBOX)
        kind, definition = unpublished_index()
        assert kind == expected_kind
        assert "(key, id)" in definition and condition in definition, definition
        # The migration itself, on this layout: dropped, then built again (concurrently, one
        # partition at a time when partitioned), and a second run has nothing to do.
        with connection.schema_editor(atomic=False) as editor:
            migration.drop_index(apps, editor)
            migration.create_index(apps, editor)
            migration.create_index(apps, editor)
        assert unpublished_index() == (kind, definition)


def storage() -> dict[str, list[str] | None]:
    """The storage parameters of the outbox table, or of each of its partitions."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, c.reloptions FROM pg_class c WHERE c.oid IN ("
            "SELECT %s::regclass WHERE NOT EXISTS (SELECT 1 FROM pg_partitioned_table "
            "WHERE partrelid = %s::regclass) "
            "UNION ALL SELECT inhrelid FROM pg_inherits WHERE inhparent = %s::regclass)",
            [TABLE] * 3,
        )
        return {name: sorted(options) if options else None for name, options in cursor}


def test_every_outbox_table_keeps_its_storage_parameters_through_the_moves(partitioned):
    """The fillfactor that makes the claim's update HOT (migration 0013) and the autovacuum
    thresholds (0014) are on the plain table, on each partition (the old table and those created
    ahead), and back on the plain table; each migration sets its own, both ways."""
    import importlib

    from django.apps import apps

    from django_idempotency.db.postgresql import OUTBOX_FILLFACTOR, OUTBOX_STORAGE

    expected = sorted(f"{name}={value}" for name, value in OUTBOX_STORAGE.items())
    assert f"fillfactor={OUTBOX_FILLFACTOR}" in expected and len(expected) == 6
    assert storage() == {TABLE: expected}
    partitioned()
    tables = storage()
    assert LEGACY in tables and len(tables) > 1
    assert set(map(tuple, tables.values())) == {tuple(expected)}
    fillfactor, autovacuum = (
        importlib.import_module(f"django_idempotency.migrations.{name}").Migration.operations[0]
        for name in ("0013_outbox_fillfactor", "0014_outbox_autovacuum")
    )
    with connection.schema_editor() as editor:  # the migrations, on this layout, back and forth
        autovacuum.reverse_code(apps, editor)
        assert set(map(tuple, storage().values())) == {(f"fillfactor={OUTBOX_FILLFACTOR}",)}
        fillfactor.reverse_code(apps, editor)
        assert set(storage().values()) == {None}
        fillfactor.code(apps, editor)
        autovacuum.code(apps, editor)
    assert storage() == tables
    partitions.unpartition_table(layout=OUTBOX)
    assert storage() == {TABLE: expected}


def test_partitioning_the_outbox_needs_its_setting(transactional_db):
    from django_idempotency.exceptions import IdempotencyConfigurationError

    with pytest.raises(IdempotencyConfigurationError, match="OUTBOX_PARTITIONS"):
        partitions.partition_table(layout=OUTBOX)
    assert not partitions.is_partitioned(layout=OUTBOX)


def test_the_relay_sends_events_from_both_sides_of_a_boundary_in_order(partitioned):
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    before = [publish_committed(payload={"n": n}, key="order-1") for n in range(3)]
    wait_until(bound + timedelta(seconds=0.1))
    after = [publish_committed(payload={"n": n}, key="order-1") for n in range(3, 6)]
    assert {partition_of(event) for event in before} == {LEGACY}
    assert {partition_of(event) for event in after} == {partitions.partition_name(bound, OUTBOX)}
    with Relay() as relay:
        relay.drain()
    assert [message.payload["n"] for message in broker.snapshot()] == list(range(6))
    assert set(OutboxEvent.objects.values_list("status", flat=True)) == {OutboxStatus.PUBLISHED}


# --- a given event id across partitions ---------------------------------------------------------


def test_a_given_event_id_is_refused_when_an_older_partition_holds_it(partitioned):
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    first = publish_committed()
    wait_until(bound + timedelta(seconds=0.1))
    with pytest.raises(DuplicateEventId, match=str(first.event_id)):
        publish_committed(event_id=first.event_id)
    assert OutboxEvent.objects.filter(event_id=first.event_id).count() == 1


def test_without_the_look_up_the_partitions_would_take_a_duplicate(
    partitioned, idempotency_settings
):
    """What the event id's lock and look-up are for: each partition's unique constraint alone
    lets the same id into two partitions."""
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    first = publish_committed()
    wait_until(bound + timedelta(seconds=0.1))
    idempotency_settings(OUTBOX_PARTITIONS=False)
    second = publish_committed(event_id=first.event_id)
    assert OutboxEvent.objects.filter(event_id=first.event_id).count() == 2
    # Moving back would fail on them (the plain table's unique index): one goes.
    second.delete()


def test_concurrent_publishes_of_one_event_id_across_the_boundary_write_it_once(partitioned):
    """One transaction publishes the id before the boundary and stays open past it; others
    publish the same id after the boundary, into the next partition. They wait for its lock,
    then find its event: one is written, each other publisher gets DuplicateEventId."""
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    event_id = uuid.uuid4()
    published = threading.Event()
    outcomes: list[str] = []

    def first() -> None:
        try:
            with transaction.atomic():
                publish("orders.paid", {"n": 0}, event_id=event_id)
                published.set()
                wait_until(bound + timedelta(seconds=0.3))  # the others publish meanwhile
            outcomes.append("written")
        finally:
            connection.close()

    def later() -> None:
        try:
            published.wait(10)
            wait_until(bound + timedelta(seconds=0.05))
            with transaction.atomic():
                publish("orders.paid", {"n": 1}, event_id=event_id)
            outcomes.append("written")
        except DuplicateEventId:
            outcomes.append("duplicate")
        finally:
            connection.close()

    threads = [threading.Thread(target=first)] + [threading.Thread(target=later) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == ["duplicate"] * 3 + ["written"]
    rows = OutboxEvent.objects.filter(event_id=event_id)
    assert rows.count() == 1
    assert partition_of(rows.get()) == LEGACY


def test_an_event_id_derived_from_a_redelivered_message_is_refused_across_partitions(partitioned):
    """A message handled again once its inbox marker is gone (swept) derives the same event
    id; the event from the first handling sits in the partition before."""
    from django_idempotency.inbox import consume_once
    from django_idempotency.models import ProcessedMessage

    bound = partitioned(database_now("default") + timedelta(seconds=1))
    with transaction.atomic(), consume_once("billing", "message-1") as consumption:
        assert consumption
        derived = publish("orders.paid", {"n": 1}).event_id
    ProcessedMessage.objects.all().delete()
    wait_until(bound + timedelta(seconds=0.1))
    with (
        pytest.raises(DuplicateEventId, match=str(derived)),
        transaction.atomic(),
        consume_once("billing", "message-1") as consumption,
    ):
        assert consumption
        publish("orders.paid", {"n": 1})
    assert OutboxEvent.objects.filter(event_id=derived).count() == 1


def test_a_publish_with_no_partition_for_its_time_fails_and_writes_nothing(
    partitioned, monkeypatch
):
    partitioned(database_now("default") + timedelta(hours=2))
    later = partitions.partitions(layout=OUTBOX)[-1].end + timedelta(hours=1)
    monkeypatch.setattr(timezone, "now", lambda: later)
    with pytest.raises(PartitionMissing, match="create --table outbox"):
        publish_committed()
    assert OutboxEvent.objects.count() == 0


# --- creation ahead and retention -----------------------------------------------------------


def test_outbox_partitions_are_created_ahead_once(partitioned, idempotency_settings):
    partitioned()
    idempotency_settings(PARTITION_AHEAD_DAYS=9)
    assert partitions.create_partitions(layout=OUTBOX)
    assert partitions.create_partitions(layout=OUTBOX) == []
    assert partitions.partitions(layout=OUTBOX)[-1].end > database_now("default") + timedelta(9)
    assert partitions.partitions(layout=partitions.RECORDS) == []  # the records table untouched


def test_retention_drops_only_published_events_past_the_retention(
    partitioned, idempotency_settings
):
    idempotency_settings(OUTBOX_RETENTION_SECONDS=86400)
    now = database_now("default")
    old = now - timedelta(days=3)
    plant(created_at=old, published_at=old)
    pending = plant(OutboxStatus.PENDING, created_at=old)
    dead = [plant(OutboxStatus.DEAD, created_at=old) for _ in range(2)]
    recent = plant(created_at=old, published_at=now)
    bound = partitioned(now + timedelta(seconds=1))
    later = past_the_legacy_retention(bound)
    # Past the retention, the legacy partition still holds a PENDING and two DEAD events
    # (``recent``, published more than a day before ``later``, is past the retention).
    refused = partitions.apply_retention(now=later, layout=OUTBOX)
    assert refused == [partitions.RetentionOutcome(LEGACY, "refused", 3)]
    assert refused[0].detail == "2 DEAD, 1 PENDING"
    assert OutboxEvent.objects.count() == 5
    # Published within the retention: kept too.
    OutboxEvent.objects.filter(pk__in=[pending.pk, *(event.pk for event in dead)]).update(
        status=OutboxStatus.PUBLISHED, published_at=later - timedelta(hours=1)
    )
    outcome = partitions.apply_retention(now=later, dry_run=True, layout=OUTBOX)
    assert outcome == [partitions.RetentionOutcome(LEGACY, "refused", 3)]
    assert outcome[0].detail == "3 published within retention"
    OutboxEvent.objects.exclude(pk=recent.pk).update(published_at=old)
    assert partitions.apply_retention(now=later, dry_run=True, layout=OUTBOX) == [
        partitions.RetentionOutcome(LEGACY, "due")
    ]
    assert partitions.apply_retention(now=later, layout=OUTBOX) == [
        partitions.RetentionOutcome(LEGACY, "dropped")
    ]
    assert OutboxEvent.objects.count() == 0
    assert LEGACY not in [part.name for part in partitions.partitions(layout=OUTBOX)]


def test_the_sweep_leaves_a_partitioned_outbox_to_retention(partitioned):
    now = database_now("default")
    old = plant(created_at=now - timedelta(days=30), published_at=now - timedelta(days=29))
    assert sweep_published_events(dry_run=True) == 1
    partitioned()
    assert sweep_published_events() == 0
    assert OutboxEvent.objects.filter(pk=old.pk).exists()


# --- the command and the task -------------------------------------------------------------------


def test_the_command_moves_the_outbox_and_refuses_to_drop_unpublished_events(
    partitioned, idempotency_settings
):
    out = StringIO()
    call_command("idempotency_partitions", "status", "--table", "outbox", stdout=out)
    assert "The outbox table is not partitioned." in out.getvalue()
    call_command("idempotency_partitions", "--table", "outbox", stdout=out)
    assert "Nothing to maintain: OUTBOX_PARTITIONS is off or the outbox table" in out.getvalue()
    idempotency_settings(OUTBOX_RETENTION_SECONDS=1)
    now = database_now("default")
    pending = plant(OutboxStatus.PENDING, created_at=now - timedelta(hours=1))
    bound = database_now("default") + timedelta(seconds=1)
    out = StringIO()
    call_command(
        "idempotency_partitions", "partition", "--table", "outbox", "--bound",
        bound.isoformat(), stdout=out, verbosity=2,
    )  # fmt: skip
    assert "Created the claim functions" not in out.getvalue()
    assert "The outbox table is partitioned" in out.getvalue()
    assert not partitions.is_partitioned(layout=partitions.RECORDS)
    out = StringIO()
    call_command("idempotency_partitions", "status", "--table", "outbox", stdout=out)
    assert f"{LEGACY}  [MINVALUE, " in out.getvalue() and "live: 1" in out.getvalue()
    wait_until(bound + timedelta(seconds=1.5))
    err = StringIO()
    with pytest.raises(CommandError, match="past OUTBOX_RETENTION_SECONDS still hold live rows"):
        call_command("idempotency_partitions", "retention", "--table", "outbox", stderr=err)
    assert f"refused to drop {LEGACY}: it holds 1 events" in err.getvalue()
    assert ": 1 PENDING" in err.getvalue()
    OutboxEvent.objects.filter(pk=pending.pk).update(
        status=OutboxStatus.PUBLISHED, published_at=now
    )
    out = StringIO()
    call_command("idempotency_partitions", "retention", "--table", "outbox", stdout=out)
    assert f"dropped {LEGACY}" in out.getvalue()
    call_command("idempotency_partitions", "unpartition", "--table", "outbox", stdout=out)
    assert "Turn IDEMPOTENCY['OUTBOX_PARTITIONS'] off" in out.getvalue()
    assert not partitions.is_partitioned(layout=OUTBOX)


def test_the_beat_task_maintains_the_outbox_partitions(partitioned, idempotency_settings):
    from django_idempotency import tasks

    assert "django-idempotency-outbox-partitions" in tasks.BEAT_SCHEDULE
    idempotency_settings(OUTBOX_PARTITIONS=False)
    assert tasks.maintain_outbox_partitions.apply().get() == {"skipped": "OUTBOX_PARTITIONS is off"}
    idempotency_settings(OUTBOX_PARTITIONS=True)
    assert tasks.maintain_outbox_partitions.apply().get() == {
        "skipped": "the outbox table is not partitioned"
    }
    partitioned()
    idempotency_settings(PARTITION_AHEAD_DAYS=6)
    result = tasks.maintain_outbox_partitions.apply().get()
    assert result["created"] and result["refused"] == {} and result["dropped"] == []
    assert tasks.maintain_outbox_partitions.apply().get()["created"] == []
    assert "skipped" in tasks.maintain_record_partitions.apply().get()  # its own table


# --- the migration under writes -----------------------------------------------------------------


class Publishers(Threads):
    """Threads that publish events (keyed, and every other one with a given event id) without
    pause until stopped; the event ids they committed, and any error."""

    def __init__(self, count: int = 3) -> None:
        super().__init__(count)
        self.committed: list[uuid.UUID] = []

    def step(self, worker: int, count: int) -> None:
        given = uuid.uuid4() if count % 2 else None
        with transaction.atomic():
            event = publish("orders.paid", {"n": count}, key=f"w{worker}", event_id=given)
        self.committed.append(event.event_id)

    def check(self) -> None:
        """Every event committed is there exactly once."""
        assert self.errors == []
        ids = list(OutboxEvent.objects.values_list("event_id", flat=True))
        assert len(ids) == len(set(ids)) == len(self.committed)
        assert set(ids) == set(self.committed)


def test_the_move_to_partitions_loses_and_duplicates_nothing_while_publishing_goes_on(
    partitioned,
):
    with Publishers() as writers:
        time.sleep(0.5)
        before = len(writers.committed)
        started = time.monotonic()
        partitioned(database_now("default") + timedelta(hours=2))
        took = time.monotonic() - started
        time.sleep(0.5)
    assert before > 0 and before < len(writers.committed)
    print(f"{len(writers.committed)} events, {before} before the move, which took {took:.2f} s")
    writers.check()


def test_the_move_back_loses_and_duplicates_nothing_while_publishing_waits(partitioned):
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    wait_until(bound + timedelta(seconds=0.1))
    with Publishers() as writers:
        time.sleep(0.5)
        before = len(writers.committed)
        waited = partitions.unpartition_table(layout=OUTBOX)
        time.sleep(0.5)
    assert 0 < before < len(writers.committed)
    assert not partitions.is_partitioned(layout=OUTBOX)
    print(f"{len(writers.committed)} events, {before} before the move back ({waited:.3f} s)")
    writers.check()


# --- the relay's tests on the partitioned outbox ------------------------------------------------

RELAY_TESTS = [
    "tests/outbox/test_relay.py",
    "tests/outbox/test_relay_concurrency.py",
    "tests/outbox/test_order.py",
    "tests/db/test_round_trips.py",
    "tests/inbox/test_consumers.py",
]


@pytest.mark.concurrency
def test_the_relay_tests_pass_on_a_partitioned_outbox(transactional_db):
    """The relay's claim and acknowledgement, per-key order, fencing, concurrent relays and
    the statements' round trips, and the inbox's tests, on an outbox and an inbox partitioned
    for the whole run with their first boundary crossed 20 s in (tests/conftest.py,
    ``tables_partitioned``). In a child pytest on a database of its own."""
    if os.environ.get("IDEMPOTENCY_TEST_PARTITIONED"):
        pytest.skip("this run is the partitioned one")
    env = {
        **os.environ,
        "IDEMPOTENCY_TEST_PARTITIONED": "outbox,inbox",
        # A name of its own, short: PostgreSQL cuts names at 63 bytes, and the child makes
        # "test_<name>_records" of it.
        "TEST_DATABASE_NAME": "outbox_partitioned_"
        + hashlib.sha256(connection.settings_dict["NAME"].encode()).hexdigest()[:12],
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--create-db",
         *RELAY_TESTS],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    tail = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in tail and "partitioned by day: outbox, inbox" in result.stdout, tail
