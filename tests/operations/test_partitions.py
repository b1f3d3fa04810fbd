"""The records table partitioned by day (``RECORD_PARTITIONS``, PostgreSQL only): the claim's
guarantee across a partition boundary the database's clock really crosses, replay, completion
and takeover across partitions, the missing partition, creation ahead and retention.

Each test turns the shared test database's plain table into the partitioned layout with the
migration itself (``partition_table``) and back (``unpartition_table``) in a fixture, whatever
happens in the test, so every other test still finds the plain table.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_idempotency.conf import conf
from django_idempotency.core.statemachine import COMPLETED, PROCESSING, Verdict
from django_idempotency.core.types import (
    Conflict,
    Decision,
    Proceed,
    Replay,
    StoredResponse,
)
from django_idempotency.db import database_now
from django_idempotency.db import postgresql as pg
from django_idempotency.db.indexes import RECORD_CREATED_INDEX
from django_idempotency.exceptions import PartitionMissing
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations import partitions
from django_idempotency.operations.sweeps import sweep_expired_records
from django_idempotency.request import claims, store
from tests.core.test_statemachine import MINE, claim_as_the_rules_say, records
from tests.reliability import outbox_helpers
from tests.support.factories import identity

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="partitions are PostgreSQL's"),
    pytest.mark.django_db(transaction=True),
]

TABLE = IdempotencyRecord._meta.db_table


def partitioned_layout(
    layout: partitions.Layout, idempotency_settings: Any
) -> Iterator[Callable[..., datetime]]:
    """A function that partitions the layout's table (the legacy partition ending at
    ``bound``), with its setting on; the table is plain again after the test, rows and all."""
    idempotency_settings(**{layout.setting: True})

    def partition(bound: datetime | None = None, **options: Any) -> datetime:
        return partitions.partition_table(bound=bound, layout=layout, **options)

    try:
        yield partition
    finally:
        for alias in connections:
            if alias != "default":
                connections[alias].close()
        if partitions.is_partitioned("default", layout):
            partitions.unpartition_table(layout=layout)
        with connection.cursor() as cursor:  # what a move that failed half-way may leave
            legacy = f"{layout.table}{partitions.LEGACY_SUFFIX}_bound"
            cursor.execute(f'ALTER TABLE "{layout.table}" DROP CONSTRAINT IF EXISTS "{legacy}"')


def past_the_legacy_retention(
    bound: datetime, retention: timedelta = timedelta(days=1)
) -> datetime:
    """A moment past the retention of the legacy partition, which ends at ``bound``, and not yet
    past that of the partition after it, which ends at the next window boundary: an hour past,
    or half way to the next one's if that comes sooner, so that the test means the same at
    any time of day (an hour before midnight, "an hour past" is past both)."""
    next_end = partitions.window_start(bound) + timedelta(days=conf.PARTITION_SPAN_DAYS)
    return bound + retention + min(timedelta(hours=1), (next_end - bound) / 2)


@pytest.fixture
def partitioned(
    transactional_db: Any, idempotency_settings: Any
) -> Iterator[Callable[..., datetime]]:
    """Call it to partition the records table; plain again after the test."""
    yield from partitioned_layout(partitions.RECORDS, idempotency_settings)


def plant(
    *,
    status: str = COMPLETED,
    created_at: datetime,
    expires_at: datetime,
    lease_expires_at: datetime | None = None,
    fingerprint: str = MINE,
    key: str | None = None,
) -> IdempotencyRecord:
    ident = identity(key=key) if key else identity()
    return IdempotencyRecord.objects.create(
        scope=ident.scope, key=ident.key, fingerprint=fingerprint, status=status,
        owner_token=uuid.uuid4(), lease_expires_at=lease_expires_at, method="POST", path="/",
        created_at=created_at, expires_at=expires_at,
        response_status=None if status == PROCESSING else 201,
        response_body=None if status == PROCESSING else b"stored",
    )  # fmt: skip


def partition_of(key: str) -> list[str]:
    """The partition holding each row of the key (one, if the guarantee holds)."""
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT tableoid::regclass::text FROM "{TABLE}" WHERE "key" = %s', [key])
        return [row[0].strip('"') for row in cursor.fetchall()]


def claim(key: str, **overrides: Any) -> Decision:
    return claims.claim(identity(key=key, **overrides), uuid.uuid4())


def claim_in_thread(key: str, done: threading.Barrier | None = None) -> Decision:
    """A claim on the thread's own connection, kept open until ``done`` (every thread has
    claimed): a winner's connection closing would free its owner lock, and the next claim
    would rightly take the key over from a request that is gone."""
    try:
        return claim(key)
    finally:
        if done is not None:
            done.wait()
        connection.close()


def wait_until(moment: datetime) -> None:
    left = (moment - database_now("default")).total_seconds()
    if left > 0:
        time.sleep(left)


def key_lock_waiters(key: str) -> int:
    """How many sessions wait for the key's lock (the advisory lock the claim takes first,
    ``pg.KEY_LOCK_STEP``) in this database."""
    scope = identity(key=key).scope
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND classid = %s AND objid = hashtext(length(%s)::text || ':' || %s || %s)::oid "
            "AND objsubid = 2",
            [pg.RECORD_KEY_LOCK_CLASS, scope, scope, key],
        )
        return int(cursor.fetchone()[0])


LEGACY = f"{TABLE}{partitions.LEGACY_SUFFIX}"


# --- the layout --------------------------------------------------------------------------------


def test_the_migration_keeps_every_row_and_goes_back(partitioned):
    now = database_now("default")
    planted = [
        plant(created_at=now - timedelta(days=3), expires_at=now + timedelta(days=1))
        for _ in range(20)
    ]
    before = sorted(IdempotencyRecord.objects.values_list("id", "scope", "key", "status"))
    bound = partitioned()
    assert partitions.is_partitioned()
    parts = partitions.partitions()
    assert parts[0] == partitions.Partition(LEGACY, None, bound)
    assert [part.start for part in parts[1:]] == [part.end for part in parts[:-1]]
    assert parts[-1].end > now + timedelta(days=3)  # PARTITION_AHEAD_DAYS
    assert sorted(IdempotencyRecord.objects.values_list("id", "scope", "key", "status")) == before
    # The identity continues after the plain table's ids.
    fresh = claim("after-the-move")
    assert isinstance(fresh, Proceed)
    new_id = IdempotencyRecord.objects.get(key="after-the-move").id
    assert new_id > max(record.id for record in planted)
    partitions.unpartition_table()
    assert not partitions.is_partitioned()
    after = sorted(IdempotencyRecord.objects.values_list("id", "scope", "key", "status"))
    assert after == sorted([*before, (new_id, "anonymous", "after-the-move", PROCESSING)])
    # The plain table's unique constraint is back, under the model's name.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass ORDER BY 1",
            [f'"{TABLE}"'],
        )
        names = [row[0] for row in cursor.fetchall()]
    assert "django_idempotency_scope_key_uniq" in names
    assert isinstance(claim("after-the-move-back"), Proceed)
    assert IdempotencyRecord.objects.get(key="after-the-move-back").id > new_id


def overview_index() -> tuple[str, bool, str, int] | None:
    """The overview's index (``db/indexes.py``): its kind (``I``: partitioned, ``i``: plain),
    whether it is valid, its definition, and how many partitions' indexes are attached to it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relkind, i.indisvalid, pg_get_indexdef(i.indexrelid), "
            "(SELECT count(*) FROM pg_inherits WHERE inhparent = i.indexrelid) "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
            [RECORD_CREATED_INDEX.name],
        )
        row = cursor.fetchone()
    return None if row is None else (row[0], row[1], row[2], row[3])


def test_the_overview_index_follows_the_moves_and_is_built_partition_by_partition(partitioned):
    import importlib

    from django.apps import apps

    migration = importlib.import_module("django_idempotency.migrations.0010_record_created_index")
    covering = "(created_at) INCLUDE (status, response_status, lease_expires_at, attempts)"
    kind, valid, definition, _ = overview_index()
    assert (kind, valid) == ("i", True) and definition.endswith(covering)

    partitioned()
    count = len(partitions.partitions())
    assert count >= 2
    kind, valid, definition, attached = overview_index()
    assert (kind, valid, attached) == ("I", True, count) and definition.endswith(covering)

    # The migration on a partitioned table: the parent's index, then each partition's, built
    # concurrently and attached; the parent's is valid once all are.
    with connection.schema_editor(atomic=False) as editor:
        migration.drop_index(apps, editor)
    assert overview_index() is None
    with connection.schema_editor(atomic=False) as editor:
        migration.create_index(apps, editor)
        migration.create_index(apps, editor)  # run again: nothing to do
    kind, valid, definition, attached = overview_index()
    assert (kind, valid, attached) == ("I", True, count) and definition.endswith(covering)
    # A partition created afterwards gets its own from the parent's.
    partitions.create_partitions(ahead_days=conf.PARTITION_AHEAD_DAYS + 2)
    assert overview_index()[3] == len(partitions.partitions()) > count

    partitions.unpartition_table()
    kind, valid, definition, _ = overview_index()
    assert (kind, valid) == ("i", True) and definition.endswith(covering)


def test_partitioning_needs_the_setting(transactional_db):
    from django_idempotency.exceptions import IdempotencyConfigurationError

    with pytest.raises(IdempotencyConfigurationError, match="RECORD_PARTITIONS"):
        partitions.partition_table()
    assert not partitions.is_partitioned()


# --- the claim's guarantee across a boundary ---------------------------------------------------


def test_a_claim_waiting_on_the_key_lock_sees_a_winner_in_the_partition_before(partitioned):
    """The race the key lock exists for: the first claim inserts just before the boundary (in
    the legacy partition) and commits after it; the second, which waited for the lock past the
    boundary, would insert into the next partition if it looked with a snapshot taken before
    the lock. It gets 409."""
    bound = partitioned(database_now("default") + timedelta(seconds=4))
    key = f"boundary-{uuid.uuid4()}"
    second: list[Decision] = []
    with transaction.atomic():
        first = claims.claim(identity(key=key), uuid.uuid4())
        assert isinstance(first, Proceed)
        assert database_now("default") < bound
        wait_until(bound + timedelta(milliseconds=200))
        thread = threading.Thread(target=lambda: second.append(claim_in_thread(key)))
        thread.start()
        # Not "still running after a while": its session is seen waiting for the key lock.
        outbox_helpers.wait_until(
            lambda: key_lock_waiters(key) == 1 or not thread.is_alive(),
            timeout=60,
            what="the second claim to wait for the key lock",
            every=0.01,
        )
        assert thread.is_alive(), "the second claim should wait for the key lock"
        assert key_lock_waiters(key) == 1
    thread.join(10)
    assert isinstance(second[0], Conflict)
    assert partition_of(key) == [LEGACY]


def test_without_the_key_lock_the_same_race_wins_twice(partitioned, monkeypatch, request):
    """The control: with the key lock made a no-op, the race above claims one key twice, one
    row in each partition. (So the test above has teeth.)"""
    monkeypatch.setattr(pg, "KEY_LOCK_STEP", "")
    claims._claim_function_text.cache_clear()  # a claim function of its own, without the lock
    request.addfinalizer(claims._claim_function_text.cache_clear)
    bound = partitioned(database_now("default") + timedelta(seconds=4))
    key = f"unlocked-{uuid.uuid4()}"
    second: list[Decision] = []
    with transaction.atomic():
        assert isinstance(claims.claim(identity(key=key), uuid.uuid4()), Proceed)
        wait_until(bound + timedelta(milliseconds=200))
        thread = threading.Thread(target=lambda: second.append(claim_in_thread(key)))
        thread.start()
        thread.join(10)
    duplicated = sorted(partition_of(key))
    IdempotencyRecord.objects.filter(key=key).delete()  # or the move back would refuse it
    assert isinstance(second[0], Proceed)
    assert duplicated == sorted([LEGACY, partitions.partition_name(bound)])


@pytest.mark.parametrize("planted", ["absent", "expired", "stale"])
def test_concurrent_claims_straddling_the_boundary_have_one_winner(partitioned, planted):
    """Threads claim each key at random moments around the boundary, which the database's
    clock crosses while they run; keys start absent, expired in an old partition, or held by a
    stale lease (the same request). Exactly one claim of each key wins, and one row is left."""
    now = database_now("default")
    bound = partitioned(now + timedelta(seconds=3))
    keys = [f"straddle-{planted}-{index}-{uuid.uuid4()}" for index in range(12)]
    for key in keys:
        if planted == "expired":
            plant(key=key, created_at=now - timedelta(days=2), expires_at=now - timedelta(days=1))
        elif planted == "stale":
            plant(
                key=key, status=PROCESSING, created_at=now - timedelta(minutes=5),
                expires_at=now + timedelta(days=1), lease_expires_at=now - timedelta(seconds=1),
            )  # fmt: skip
    decisions: dict[str, list[Decision]] = {key: [] for key in keys}
    start, done = threading.Barrier(len(keys) * 4), threading.Barrier(len(keys) * 4)

    def run(key: str, delay: float) -> None:
        start.wait()
        time.sleep(delay)
        decisions[key].append(claim_in_thread(key, done))

    wait_until(bound - timedelta(milliseconds=400))
    threads = [
        threading.Thread(target=run, args=(key, random.uniform(0, 0.8)))
        for key in keys
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert database_now("default") > bound
    sides = set()
    for key in keys:
        winners = [decision for decision in decisions[key] if isinstance(decision, Proceed)]
        assert len(winners) == 1, (key, decisions[key])
        assert len(decisions[key]) == 4
        rows = partition_of(key)
        assert len(rows) == 1, rows
        sides.add(rows[0])
        if planted != "stale":  # a takeover keeps its first claim time, and so its partition
            assert rows[0] in (LEGACY, partitions.partition_name(bound))
    print("winning rows by partition:", sorted(sides))


# --- replay, completion and takeover across partitions ----------------------------------------


def test_a_completed_record_in_an_old_partition_replays(partitioned):
    now = database_now("default")
    record = plant(created_at=now - timedelta(hours=20), expires_at=now + timedelta(hours=4))
    partitioned(now + timedelta(seconds=1))
    wait_until(now + timedelta(seconds=1.2))
    decision = claim(record.key)
    assert isinstance(decision, Replay)
    assert decision.response.body == b"stored"
    assert store.read(record.scope, record.key) is not None


def test_a_claim_before_the_boundary_completes_after_it(partitioned):
    bound = partitioned(database_now("default") + timedelta(seconds=4))
    key = f"complete-across-{uuid.uuid4()}"
    decision = claim(key)
    assert isinstance(decision, Proceed)
    assert store.extend(decision.lease)
    wait_until(bound + timedelta(milliseconds=100))
    with transaction.atomic():
        assert store.complete(decision.lease, StoredResponse(201, [], b"done"))
    assert partition_of(key) == [LEGACY]
    again = claim(key)
    assert isinstance(again, Replay)
    assert again.response.body == b"done"
    state = store.read("anonymous", key)
    assert state is not None and state.status == COMPLETED


def test_an_expired_record_taken_over_moves_to_the_current_partition(partitioned):
    now = database_now("default")
    old = plant(created_at=now - timedelta(days=2), expires_at=now - timedelta(days=1))
    bound = partitioned(now + timedelta(seconds=1))
    assert partition_of(old.key) == [LEGACY]
    wait_until(bound + timedelta(milliseconds=100))
    decision = claim(old.key, fingerprint="e" * 64)  # a new request reusing an expired key
    assert isinstance(decision, Proceed)
    assert decision.lease.attempt == 1
    assert partition_of(old.key) == [partitions.partition_name(bound)]
    # The old partition now holds nothing live: retention may drop it.
    assert partitions.live_rows(LEGACY, database_now("default")) == 0


def test_a_stale_takeover_keeps_its_row(partitioned):
    now = database_now("default")
    stale = plant(
        status=PROCESSING, created_at=now - timedelta(minutes=1),
        expires_at=now + timedelta(days=1), lease_expires_at=now - timedelta(seconds=1),
    )  # fmt: skip
    partitioned(now + timedelta(seconds=1))
    decision = claim(stale.key)
    assert isinstance(decision, Proceed)
    assert decision.lease.attempt == 2
    assert IdempotencyRecord.objects.get(key=stale.key).id == stale.id


def test_a_claim_with_no_partition_for_its_time_fails_and_writes_nothing(partitioned):
    bound = partitioned(database_now("default") + timedelta(seconds=1))
    for part in partitions.partitions()[1:]:
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{TABLE}" DETACH PARTITION "{part.name}"')
            cursor.execute(f'DROP TABLE "{part.name}"')
    wait_until(bound + timedelta(milliseconds=100))
    key = f"nowhere-{uuid.uuid4()}"
    with pytest.raises(PartitionMissing, match="idempotency_partitions create"):
        claim(key)
    assert partition_of(key) == []
    partitions.create_partitions()
    assert isinstance(claim(key), Proceed)
    assert partition_of(key) == [partitions.partition_name(partitions.window_start(bound))]


def test_the_claim_inside_a_transaction_holds_the_key_lock_until_it_ends(partitioned):
    partitioned()
    key = f"in-atomic-{uuid.uuid4()}"

    def key_locks() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
                "AND pid = pg_backend_pid()",
                [pg.RECORD_KEY_LOCK_CLASS],
            )
            return int(cursor.fetchone()[0])

    with transaction.atomic():
        assert isinstance(claims.claim(identity(key=key), uuid.uuid4()), Proceed)
        assert key_locks() == 1
    assert key_locks() == 0
    # In autocommit the lock lasts the one message: none is left behind.
    assert isinstance(claim(f"autocommit-{uuid.uuid4()}"), Proceed)
    assert key_locks() == 0


# --- creation ahead, retention, the sweep -----------------------------------------------------


def test_partitions_are_created_ahead_once(partitioned, idempotency_settings):
    partitioned()
    idempotency_settings(PARTITION_AHEAD_DAYS=10)
    created = partitions.create_partitions()
    assert created
    assert partitions.create_partitions() == []
    assert partitions.partitions()[-1].end > database_now("default") + timedelta(days=10)
    ends = [part.end for part in partitions.partitions()]
    assert len(set(ends)) == len(ends)


def test_retention_drops_dead_partitions_and_refuses_live_ones(partitioned):
    now = database_now("default")
    plant(created_at=now - timedelta(days=3), expires_at=now - timedelta(days=2))
    bound = partitioned(now + timedelta(seconds=1))
    later = past_the_legacy_retention(bound)
    # The legacy partition (ended at the bound) is past the TTL, and what it holds expired.
    assert partitions.apply_retention(now=later, dry_run=True) == [
        partitions.RetentionOutcome(LEGACY, "due")
    ]
    live = plant(created_at=now - timedelta(hours=1), expires_at=later + timedelta(hours=1))
    outcome = partitions.apply_retention(now=later)
    assert outcome == [partitions.RetentionOutcome(LEGACY, "refused", 1)]
    assert IdempotencyRecord.objects.filter(pk=live.pk).exists()
    IdempotencyRecord.objects.filter(pk=live.pk).update(expires_at=now)
    assert partitions.apply_retention(now=later) == [partitions.RetentionOutcome(LEGACY, "dropped")]
    assert LEGACY not in [part.name for part in partitions.partitions()]
    assert not IdempotencyRecord.objects.filter(created_at__lt=bound).exists()


def test_retention_refuses_a_partition_held_by_a_running_lease(partitioned):
    now = database_now("default")
    bound = partitioned(now + timedelta(seconds=1))
    later = past_the_legacy_retention(bound)
    plant(
        status=PROCESSING, created_at=now - timedelta(hours=1), expires_at=now,
        lease_expires_at=later + timedelta(minutes=1),
    )  # fmt: skip
    assert partitions.apply_retention(now=later) == [
        partitions.RetentionOutcome(LEGACY, "refused", 1)
    ]


def test_the_sweep_leaves_a_partitioned_table_to_retention(partitioned):
    now = database_now("default")
    expired = plant(created_at=now - timedelta(days=3), expires_at=now - timedelta(days=2))
    partitioned()
    assert sweep_expired_records() == 0
    assert IdempotencyRecord.objects.filter(pk=expired.pk).exists()


# --- the partitioned claim statement against the state machine ---------------------------------


@hypothesis_settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_partitioned_claim_decides_what_the_rules_say(partitioned_once, data):
    """``tests/core/test_statemachine.py``'s property, for the partitioned claim statement: whatever
    record a claim finds (in the partition before, or in the current one), its decision is the
    state machine's verdict, judged by the database's own clock."""
    now = database_now("default")
    created_at = now - timedelta(days=data.draw(st.sampled_from([0, 2])))
    ident = identity(fingerprint=MINE)
    verdict = claim_as_the_rules_say(ident, data.draw(records(now)), created_at=created_at)
    rows = partition_of(ident.key)
    assert len(rows) == 1
    if verdict is Verdict.CLAIM:  # a new request: its row is in the partition of now
        assert rows[0] == partitions.partition_name(partitions.window_start(now))


@pytest.fixture
def partitioned_once(partitioned: Callable[..., datetime]) -> None:
    """Partitioned with the legacy partition ending two days ago: every claim lands in a day
    partition, and a record two days old in the one before."""
    now = database_now("default")
    bound = partitions.window_start(now - timedelta(days=3))
    partitioned(bound)
    start = bound
    while start <= now:
        end = start + timedelta(days=1)
        if partitions.partition_name(start) not in {part.name for part in partitions.partitions()}:
            partitions.create_partition(start, end)
        start = end


# --- the system checks, on the real table -----------------------------------------------------


def test_the_checks_see_the_layout_and_the_missing_next_partition(partitioned):
    from django_idempotency import checks

    def found() -> set[str]:
        storage = [check for check in checks.STORAGE_CHECKS if "database" in check.tags]
        return {message.id for check in storage for message in check(databases=["default"])}

    assert found() == {checks.W080}  # the setting is on, the table still plain
    bound = partitioned(database_now("default") + timedelta(hours=2))
    assert found() == set()
    for part in partitions.partitions()[1:]:
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{TABLE}" DETACH PARTITION "{part.name}"')
            cursor.execute(f'DROP TABLE "{part.name}"')
    assert partitions.partitions()[-1].end == bound
    assert found() == {checks.W081}


# --- the command and the task -------------------------------------------------------------------


def test_the_command_partitions_reports_and_moves_back(partitioned):
    from io import StringIO

    from django.core.management import CommandError, call_command

    out = StringIO()
    call_command("idempotency_partitions", "status", stdout=out)
    assert "not partitioned" in out.getvalue()
    call_command("idempotency_partitions", stdout=out)  # maintain: nothing to do yet, no error
    assert "Nothing to maintain" in out.getvalue()
    with pytest.raises(CommandError, match="not partitioned"):
        call_command("idempotency_partitions", "create")
    call_command("idempotency_partitions", "partition", "--bound", "+2h", stdout=out, verbosity=2)
    assert "Validated it" in out.getvalue() and "Swapped" in out.getvalue()
    assert partitions.is_partitioned()
    out = StringIO()
    call_command("idempotency_partitions", "status", stdout=out)
    assert f"{LEGACY}  [MINVALUE, " in out.getvalue()
    out = StringIO()
    call_command("idempotency_partitions", "create", "--ahead-days", "8", stdout=out)
    assert "created" in out.getvalue()
    call_command("idempotency_partitions", stdout=out)  # maintain
    assert "created 0 partitions" in out.getvalue()
    call_command("idempotency_partitions", "unpartition", stdout=out)
    assert not partitions.is_partitioned()
    assert "one plain table again" in out.getvalue()


def test_the_command_refuses_to_drop_a_partition_with_live_records(
    partitioned, idempotency_settings
):
    from io import StringIO

    from django.core.management import CommandError, call_command

    idempotency_settings(TTL_SECONDS=1, LEASE_SECONDS=1)
    now = database_now("default")
    live = plant(created_at=now - timedelta(hours=1), expires_at=now + timedelta(days=1))
    bound = partitioned(now + timedelta(seconds=1))
    wait_until(bound + timedelta(seconds=1.5))
    err = StringIO()
    with pytest.raises(CommandError, match="still hold live rows"):
        call_command("idempotency_partitions", "retention", stderr=err)
    assert f"refused to drop {LEGACY}: it holds 1 live records" in err.getvalue()
    IdempotencyRecord.objects.filter(pk=live.pk).update(expires_at=now)
    out = StringIO()
    call_command("idempotency_partitions", "retention", "--dry-run", stdout=out)
    assert f"would drop {LEGACY}" in out.getvalue()
    call_command("idempotency_partitions", "retention", stdout=out)
    assert f"dropped {LEGACY}" in out.getvalue()
    assert not IdempotencyRecord.objects.filter(pk=live.pk).exists()


def test_the_beat_task_maintains_the_partitions(partitioned, idempotency_settings):
    from django_idempotency import tasks

    assert "django-idempotency-record-partitions" in tasks.BEAT_SCHEDULE
    idempotency_settings(RECORD_PARTITIONS=False)
    assert tasks.maintain_record_partitions.apply().get() == {"skipped": "RECORD_PARTITIONS is off"}
    idempotency_settings(RECORD_PARTITIONS=True)
    assert "skipped" in tasks.maintain_record_partitions.apply().get()  # still plain
    partitioned()
    idempotency_settings(PARTITION_AHEAD_DAYS=6)
    result = tasks.maintain_record_partitions.apply().get()
    assert result["created"] and result["refused"] == {} and result["dropped"] == []
    assert tasks.maintain_record_partitions.apply().get()["created"] == []


# --- the migration under writes -----------------------------------------------------------------


class Threads:
    """Threads that each run ``step(worker, count)`` for count 0, 1, ... without pause until
    stopped, on connections of their own; any error is kept in ``errors``."""

    def __init__(self, count: int = 3) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self.run, args=(n,)) for n in range(count)]

    def __enter__(self) -> Any:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def run(self, worker: int) -> None:
        try:
            for count in range(1_000_000):
                if self.stop.is_set():
                    break
                self.step(worker, count)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            connection.close()

    def step(self, worker: int, count: int) -> None:
        raise NotImplementedError


class Writers(Threads):
    """Threads that claim and complete keys without pause (and claim every completed key
    again, to replay it) until stopped; what they won and completed, and any error."""

    def __init__(self, prefix: str, count: int = 3) -> None:
        super().__init__(count)
        self.prefix = prefix
        self.won: list[str] = []
        self.completed: list[str] = []

    def step(self, worker: int, count: int) -> None:
        key = f"{self.prefix}-{worker}-{count}"
        decision = claim(key)
        if not isinstance(decision, Proceed):
            self.errors.append(AssertionError(f"{key}: {decision}"))
            return
        self.won.append(key)
        if count % 2:
            with transaction.atomic():
                assert store.complete(decision.lease, StoredResponse(201, [], b"ok"))
            self.completed.append(key)
            assert isinstance(claim(key), Replay)

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
        """Wait until the writers have done ``what``, however slow the machine; an error, or
        every writer stopped, ends the wait at once."""
        outbox_helpers.wait_until(
            lambda: (
                condition()
                or bool(self.errors)
                or not any(thread.is_alive() for thread in self.threads)
            ),
            timeout=timeout,
            what=what,
            every=0.01,
        )
        assert self.errors == []
        assert condition(), f"the writers stopped before {what}: {len(self.won)} keys won"

    def wait_for_every_writer(self) -> None:
        """Wait until each writer has won a key: all of them are writing."""
        self.wait_for(
            lambda: len({key.rsplit("-", 2)[1] for key in self.won}) == len(self.threads),
            "every writer to win a key",
        )

    def wait_for_a_key_begun_after(self, count: int) -> None:
        """Wait until some key was claimed wholly after the writers had won ``count``: each
        writer may have had one claim under way then, so more than that many more."""
        self.wait_for(
            lambda: len(self.won) > count + len(self.threads),
            f"a key claimed after the first {count}",
        )

    def check(self) -> None:
        """Every key won is there exactly once, completed as the writer left it."""
        assert self.errors == []
        rows = IdempotencyRecord.objects.filter(key__startswith=f"{self.prefix}-")
        assert rows.count() == len(self.won)
        statuses = dict(rows.values_list("key", "status"))
        assert set(statuses) == set(self.won)
        done = {key for key, status in statuses.items() if status == COMPLETED}
        assert done == set(self.completed)


def test_the_move_to_partitions_loses_and_duplicates_nothing_while_writes_go_on(partitioned):
    with Writers("forward") as writers:
        writers.wait_for_every_writer()
        before = len(writers.won)
        started = time.monotonic()
        partitioned(database_now("default") + timedelta(hours=2))
        took = time.monotonic() - started
        during = len(writers.won)
        writers.wait_for_a_key_begun_after(during)
    assert before > 0 and during < len(writers.won)  # writers ran before the move and after it
    print(f"{len(writers.won)} keys written, {before} before the move, which took {took:.2f} s")
    writers.check()


def test_the_move_back_loses_and_duplicates_nothing_while_writes_wait(partitioned):
    partitioned(database_now("default") + timedelta(hours=2))
    now = database_now("default")
    for _ in range(200):
        plant(created_at=now - timedelta(hours=1), expires_at=now + timedelta(hours=1))
    with Writers("backward") as writers:
        writers.wait_for_every_writer()
        before = len(writers.won)
        waited = partitions.unpartition_table()
        writers.wait_for_a_key_begun_after(len(writers.won))
    assert 0 < before < len(writers.won)
    assert not partitions.is_partitioned()
    print(
        f"{len(writers.won)} keys written, {before} before the move back, "
        f"which stopped writes for {waited:.3f} s"
    )
    writers.check()
    assert IdempotencyRecord.objects.count() == 200 + len(writers.won)


def test_the_claim_functions_are_created_when_missing(partitioned):
    """Inside a transaction a missing function is not created (it would stay invisible to the
    other claims, and its creator's lock held, until that transaction ends): the claim runs as
    two statements there. In autocommit the claim creates it."""
    partitioned()

    def functions() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_proc WHERE proname LIKE 'django_idempotency_claim_%%'"
            )
            return int(cursor.fetchone()[0])

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT string_agg(oid::regprocedure::text, ', ') FROM pg_proc "
            "WHERE proname LIKE 'django_idempotency_claim_%%'"
        )
        cursor.execute(f"DROP FUNCTION {cursor.fetchone()[0]}")
    claims._functions_seen.clear()
    assert functions() == 0
    key = f"two-statements-{uuid.uuid4()}"
    with transaction.atomic():
        assert isinstance(claims.claim(identity(key=key), uuid.uuid4()), Proceed)
        assert functions() == 0
    assert len(partition_of(key)) == 1
    assert isinstance(claim(f"autocommit-{uuid.uuid4()}"), Proceed)
    assert functions() == 1


def test_a_failed_move_leaves_the_plain_table_as_it_was(partitioned, monkeypatch):
    from django.db import DataError

    monkeypatch.setattr(partitions, "_partition_ddl", lambda *args: ["SELECT 1 / 0"])
    with pytest.raises(DataError):
        partitioned(database_now("default") + timedelta(seconds=1))
    assert not partitions.is_partitioned()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c'",
            [f'"{TABLE}"'],
        )
        assert cursor.fetchone()[0] == 0  # the CHECK on created_at is gone
    time.sleep(1.2)  # past the bound the CHECK would have had
    assert isinstance(claim(f"after-a-failed-move-{uuid.uuid4()}"), Proceed)


# --- the whole lifecycle on a partitioned table -------------------------------------------------


def _lifecycle_tests() -> list[str]:
    """``tests/request/test_lifecycle.py``'s tests of the claim (``claim_path``) that take no
    parameters of their own."""
    import inspect

    from tests.request import test_lifecycle

    return [
        name
        for name, function in vars(test_lifecycle).items()
        if name.startswith("test_")
        and "claim_path" in inspect.signature(function).parameters
        and not getattr(function, "pytestmark", None)
    ]


@pytest.mark.parametrize("name", _lifecycle_tests())
def test_the_lifecycle_on_a_partitioned_table(partitioned, request, name):
    """Every row of DESIGN.md through the lifecycle (claim, run, complete or release, replay,
    409, 422, takeover, lease lost), on the partitioned table."""
    import inspect

    from tests.request import test_lifecycle

    partitioned()
    test = getattr(test_lifecycle, name)
    arguments = {
        parameter: "partitioned"
        if parameter == "claim_path"
        else request.getfixturevalue(parameter)
        for parameter in inspect.signature(test).parameters
    }
    test(**arguments)
