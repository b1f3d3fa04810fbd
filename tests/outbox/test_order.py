"""Same-key events leave the outbox in commit order, on every backend, with several relays.

Transactions run on threads of their own, each with its own database connection, and the test
decides when each one writes, publishes, commits or rolls back. Where a step must wait for a
lock, the test watches the database until the waiting transaction shows up as waiting (never a
sleep), then checks what it had not done yet.
"""

from __future__ import annotations

import importlib
import queue
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.db import DatabaseError, OperationalError, connection, connections, transaction
from freezegun import freeze_time

from django_idempotency.models import OutboxEvent, OutboxKeyLock
from django_idempotency.outbox import publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import database_now, publish_committed, wait_for
from tests.testapp.models import Widget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.concurrency]

SERVER_BACKENDS = ("postgresql", "mysql")


@pytest.fixture(autouse=True)
def clean():
    broker.clear()
    yield
    broker.clear()


@pytest.fixture(autouse=True)
def end_open_transactions():
    """A failed test must not leave a transaction open: the database's teardown would wait."""
    yield
    for steps in Steps.open:
        steps._steps.put(_ROLLBACK)
    for steps in Steps.open:
        steps.ended.wait(60)
    Steps.open.clear()


def needs_server_locks() -> None:
    if connection.vendor not in SERVER_BACKENDS:
        pytest.skip("SQLite never runs two writers at once (see test_sqlite_writers_take_turns)")


# --- transactions the test steps through -------------------------------------------------------


class _Rollback(Exception):
    pass


_COMMIT, _ROLLBACK = object(), object()


class Steps:
    """One transaction on a thread and connection of its own, doing one step at a time."""

    #: Every instance, for the teardown.
    open: list[Steps] = []

    def __init__(self) -> None:
        Steps.open.append(self)
        self._steps: queue.Queue[Any] = queue.Queue()
        self._results: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue()
        self.ended = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, daemon=True).start()
        self.backend: int = self.do(_backend_id)

    def _run(self) -> None:
        try:
            with transaction.atomic():
                while (step := self._steps.get()) is not _COMMIT:
                    if step is _ROLLBACK:
                        raise _Rollback
                    try:
                        self._results.put((step(), None))
                    except BaseException as exc:
                        self._results.put((None, exc))
                        raise
        except _Rollback:
            pass
        except BaseException as exc:
            self.error = exc
        finally:
            connections.close_all()
            self.ended.set()

    def start(self, step: Callable[[], Any]) -> None:
        """Send a step without waiting for it (it may wait for a lock)."""
        self._steps.put(step)

    def has_result(self) -> bool:
        return not self._results.empty()

    def result(self) -> Any:
        value, error = self._results.get(timeout=60)
        if error is not None:
            raise error
        return value

    def do(self, step: Callable[[], Any]) -> Any:
        self.start(step)
        return self.result()

    def commit(self) -> None:
        self._end(_COMMIT)
        assert self.error is None, self.error

    def rollback(self) -> None:
        self._end(_ROLLBACK)

    def _end(self, how: object) -> None:
        self._steps.put(how)
        assert self.ended.wait(60), "the transaction did not end"


def _backend_id() -> int:
    """This connection's id on the server, to find it among the sessions waiting for a lock."""
    if connection.vendor == "sqlite":
        return 0
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


def waiting_for_a_lock(backend: int) -> bool:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [backend])
            row = cursor.fetchone()
            return row is not None and row[0] == "Lock"
        cursor.execute(
            "SELECT trx_state FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = %s",
            [backend],
        )
        row = cursor.fetchone()
        return row is not None and row[0] == "LOCK WAIT"


def wait_until_blocked(steps: Steps) -> None:
    wait_for(lambda: waiting_for_a_lock(steps.backend), what="the transaction to wait for a lock")


@contextmanager
def running_relays(count: int = 3) -> Iterator[list[BaseException]]:
    """``count`` relays polling side by side until the block ends; yields their errors."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with Relay(batch_size=5) as relay:
                relay.run_forever(stop, poll_seconds=0.02)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    try:
        yield errors
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def delivered(count: int) -> list[Any]:
    wait_for(lambda: len(broker.snapshot()) >= count, what=f"{count} events to be published")
    return [message.event_id for message in broker.snapshot()]


# --- the behaviour -----------------------------------------------------------------------------


def test_a_transaction_that_began_first_and_commits_last_is_delivered_last():
    """Issue 12, item 5: T1 writes first (PostgreSQL gives it the older transaction id), T2
    publishes key K and commits, then T1 publishes K and commits."""
    needs_server_locks()
    with running_relays() as errors:
        first = Steps()
        first.do(lambda: Widget.objects.create(name="began first"))
        second = Steps()
        second_event = second.do(lambda: publish("orders.paid", {"n": 2}, key="K"))
        second.commit()
        first_event = first.do(lambda: publish("orders.paid", {"n": 1}, key="K"))
        first.commit()
        assert delivered(2) == [second_event.event_id, first_event.event_id]
    assert errors == []


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_second_publisher_of_a_key_waits_until_the_first_ends(outcome):
    needs_server_locks()
    with running_relays() as errors:
        first = Steps()
        first_event = first.do(lambda: publish("orders.paid", {"n": 1}, key="K"))
        second = Steps()
        second.start(lambda: publish("orders.paid", {"n": 2}, key="K"))
        wait_until_blocked(second)
        # Other keys, and events without a key, do not wait for the lock.
        other = publish_committed(payload={"n": 3}, key="other")
        keyless = publish_committed(payload={"n": 4})
        assert not second.has_result()
        if outcome == "commit":
            first.commit()
        else:
            first.rollback()
        second_event = second.result()
        second.commit()
        expected = [second_event.event_id]
        if outcome == "commit":
            assert second_event.pk > first_event.pk
            expected.insert(0, first_event.event_id)
        sent = delivered(len(expected) + 2)
        assert [m.event_id for m in broker.snapshot() if m.key == "K"] == expected
        assert set(sent) == {*expected, other.event_id, keyless.event_id}
    assert errors == []


def test_sqlite_writers_take_turns():
    """SQLite needs no lock of its own: a transaction that wrote holds the write lock until it
    ends, so no other transaction can insert an event in between (db/sqlite.py)."""
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")
    first = Steps()
    first_event = first.do(lambda: publish("orders.paid", {"n": 1}, key="K"))

    def publish_without_waiting() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA busy_timeout = 0")
            publish_committed(payload={"n": 2}, key="K")
        finally:
            connections.close_all()

    refused: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(publish_without_waiting, refused))
    thread.start()
    thread.join(60)
    assert [type(error) for error in refused] == [OperationalError]
    assert "locked" in str(refused[0])
    first.commit()
    second_event = publish_committed(payload={"n": 2}, key="K")
    assert second_event.pk > first_event.pk
    with Relay() as relay:
        relay.drain()
    assert [m.event_id for m in broker.snapshot()] == [first_event.event_id, second_event.event_id]


def _catch(function: Callable[[], Any], errors: list[BaseException]) -> None:
    try:
        function()
    except BaseException as exc:
        errors.append(exc)


def test_a_key_locked_in_a_rolled_back_savepoint_is_locked_again():
    """Rolling back a savepoint releases the locks taken inside it, while the transaction's
    on-commit kick, registered before the savepoint, lives on: the next publish of the key
    must lock it again."""
    needs_server_locks()

    def publish_in_a_savepoint_then_again() -> OutboxEvent:
        publish("orders.paid", {"n": 0})  # registers the transaction's kick outside the savepoint
        try:
            with transaction.atomic():
                publish("orders.paid", {"n": -1}, key="K")
                raise _Rollback
        except _Rollback:
            pass
        return publish("orders.paid", {"n": 1}, key="K")

    first = Steps()
    first_event = first.do(publish_in_a_savepoint_then_again)
    second = Steps()
    second.start(lambda: publish("orders.paid", {"n": 2}, key="K"))
    wait_until_blocked(second)
    first.commit()
    second_event = second.result()
    second.commit()
    assert second_event.pk > first_event.pk


def test_publishers_of_two_keys_in_opposite_orders_deadlock_and_one_is_rolled_back():
    """The cost of the lock, as with any row lock: lock keys in a stable order."""
    needs_server_locks()
    first, second = Steps(), Steps()
    first.do(lambda: publish("orders.paid", {"n": 1}, key="A"))
    second.do(lambda: publish("orders.paid", {"n": 2}, key="B"))
    first.start(lambda: publish("orders.paid", {"n": 3}, key="B"))
    wait_until_blocked(first)
    second.start(lambda: publish("orders.paid", {"n": 4}, key="A"))
    outcomes = []
    for steps in (first, second):
        try:
            steps.result()
            outcomes.append("published")
        except DatabaseError as exc:
            outcomes.append("deadlock" if "deadlock" in str(exc).lower() else str(exc))
    assert sorted(outcomes) == ["deadlock", "published"]
    survivor = (first, second)[outcomes.index("published")]
    survivor.commit()
    (first, second)[outcomes.index("deadlock")].rollback()
    assert OutboxEvent.objects.count() == 2


def test_the_portable_lock_makes_a_second_locker_wait():
    """The ORM form of the key lock, for backends without a statement of their own in db/:
    the first use of a bucket inserts its row, and a second transaction waits for it."""
    needs_server_locks()
    first = Steps()
    first.do(lambda: OutboxKeyLock.objects.lock("K"))
    second = Steps()
    second.start(lambda: OutboxKeyLock.objects.lock("K"))
    wait_until_blocked(second)
    first.commit()
    second.result()  # the row now exists: locked FOR UPDATE
    third = Steps()
    third.start(lambda: OutboxKeyLock.objects.lock("K"))
    wait_until_blocked(third)
    second.commit()
    third.result()
    third.commit()
    assert OutboxKeyLock.objects.count() == 1


def test_per_key_delivery_order_is_commit_order_under_load():
    """Publishers on many threads, some rolling back, while three relays drain.

    The reference order does not trust the lock under test: just before it commits, each
    transaction bumps a counter row per key it published, under that row's own lock, which it
    holds until it ends; so the counter values of a key's committed transactions follow their
    commits.
    """
    keys = ["a", "b", "c"]
    # By primary key: a scan for a name would wait on the other counters' locks (deadlocks).
    counters = {
        key: Widget.objects.create(name=f"commits:{key}", created_by="0").pk for key in keys
    }
    stamps: dict[Any, tuple[str, int]] = {}  # event id -> (key, commit stamp)
    rolled_back: set[Any] = set()
    errors: list[BaseException] = []
    record = threading.Lock()

    def stamp(key: str) -> int:
        counter = Widget.objects.select_for_update().get(pk=counters[key])
        counter.created_by = str(int(counter.created_by) + 1)
        counter.save(update_fields=["created_by"])
        return int(counter.created_by)

    def publisher(seed: int) -> None:
        chance = random.Random(seed)
        try:
            for n in range(12):
                chosen = sorted(chance.sample(keys, chance.choice([1, 1, 2])))  # stable order
                events: dict[Any, str] = {}
                try:
                    with transaction.atomic():
                        if chance.random() < 0.3:
                            publish("orders.paid", {"n": n})  # keyless: takes no lock
                        for key in chosen:
                            events[publish("orders.paid", {"n": n}, key=key).event_id] = key
                        numbers = {key: stamp(key) for key in chosen}
                        if chance.random() < 0.2:
                            raise _Rollback
                except _Rollback:
                    with record:
                        rolled_back.update(events)
                    continue
                with record:
                    for event_id, key in events.items():
                        stamps[event_id] = (key, numbers[key])
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    with running_relays() as relay_errors:
        threads = [threading.Thread(target=publisher, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert errors == []
        wait_for(
            lambda: not OutboxEvent.objects.unpublished().exists(),
            timeout=120,
            what="the relays to drain the outbox",
        )
    assert relay_errors == []
    messages = [m for m in broker.snapshot() if m.key]
    sent = [m.event_id for m in messages]
    assert set(sent) == set(stamps) and not rolled_back & set(sent)
    assert len(sent) == len(set(sent))  # no lease ran out: each event once
    for key in keys:
        order = [stamps[m.event_id][1] for m in messages if m.key == key]
        assert order == sorted(order) and len(order) == len(set(order)), (key, order)
        assert len(order) == int(Widget.objects.get(pk=counters[key]).created_by)


# --- the relay's clock -------------------------------------------------------------------------


def test_a_relay_whose_clock_runs_ahead_cannot_claim_an_event_another_relay_holds():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no clock of its own: its processes share one machine's")
    event = publish_committed()
    holder = Relay(lease_seconds=60)
    claimed, clock = holder._claim()
    assert [e.pk for e in claimed] == [event.pk]
    # Ten minutes ahead, this relay would think the 60 s lease long over by its own clock.
    with freeze_time(database_now() + timedelta(minutes=10)), Relay() as ahead:
        assert ahead.run_once().claimed == 0
    stats = holder._ack(claimed, holder._publish(claimed, deadline=float("inf")), clock)
    holder.close()
    assert stats.published == 1 and stats.lost == 0
    assert [m.event_id for m in broker.snapshot()] == [event.event_id]


def test_a_relay_whose_clock_runs_behind_schedules_backoff_by_the_database(idempotency_settings):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no clock of its own: its processes share one machine's")
    # A backoff of seconds (8 s with this seed), so the retry is not due by the time the
    # second relay looks, however slow the host (at the default 1 s base it was 134 ms).
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=60)
    event = publish_committed()
    broker.fail_when(lambda m: True)
    before = database_now()
    with freeze_time(before - timedelta(minutes=10)), Relay(rng=random.Random(1)) as behind:
        assert behind.run_once().failed == 1
    event.refresh_from_db()
    # By its own clock the retry would be due already; by the database's it is not.
    assert event.next_attempt_at >= before
    broker.fail_when(None)
    with Relay() as relay:
        assert relay.run_once().claimed == 0


def test_an_event_that_never_failed_is_due_whatever_the_publishers_clock():
    with freeze_time(database_now() + timedelta(minutes=10)):
        ahead = publish_committed()
    with Relay() as relay:
        assert relay.drain().published == 1
    assert [m.event_id for m in broker.snapshot()] == [ahead.event_id]


# --- upgrade and admin -------------------------------------------------------------------------


def test_the_migration_puts_unpublished_events_of_the_old_order_in_id_order():
    migration = importlib.import_module("django_idempotency.migrations.0004_outbox_key_lock")
    pending = publish_committed()
    dead = publish_committed()
    done = publish_committed()
    OutboxEvent.objects.filter(pk=pending.pk).update(transaction_id=900)
    OutboxEvent.objects.filter(pk=dead.pk).update(transaction_id=901, status="DEAD")
    OutboxEvent.objects.filter(pk=done.pk).update(transaction_id=902, status="PUBLISHED")

    migration.zero_unpublished_transaction_ids(apps, SimpleNamespace(connection=connection))
    assert dict(OutboxEvent.objects.values_list("pk", "transaction_id")) == {
        pending.pk: 0,
        dead.pk: 0,
        done.pk: 902,
    }


def test_the_key_lock_table_is_not_in_the_admin():
    assert admin.site.is_registered(OutboxEvent)
    assert not admin.site.is_registered(OutboxKeyLock)
