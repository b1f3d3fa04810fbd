"""The outbox under broker outages and a killed relay: nothing committed is lost, nothing rolled
back is sent.

Business transactions publish through ``publish()`` in threads while ``outbox_relay --loop`` runs
in a process of its own and sends to a private RabbitMQ node with publisher confirms. The node
is stopped cleanly and later SIGKILLed, each time for a few seconds, while the load goes on; the
relay is never restarted. Then a relay is SIGKILLed with a batch claimed, and another one takes
its events over once their lease runs out.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from datetime import datetime, timedelta

import pytest
from django.db.models import Min, Q
from django.utils import timezone
from kombu import Connection

from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from tests.reliability.broker import RabbitNode
from tests.reliability.outbox_helpers import (
    Delivery,
    Load,
    RelayProcess,
    consume_all,
    declare_sink,
    duplicates,
    figures,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

Status = OutboxEvent.Status


@pytest.fixture(scope="module")
def rabbit() -> Iterator[RabbitNode]:
    with RabbitNode.running() as node:
        yield node


@pytest.fixture
def sink(rabbit: RabbitNode) -> tuple[str, str]:
    """A fresh exchange and durable queue on the private node, for one test."""
    name = f"rel-outbox-{uuid.uuid4().hex[:8]}"
    declare_sink(rabbit.url, name, name)
    return name, name


def _unpublished() -> int:
    return OutboxEvent.objects.exclude(status=Status.PUBLISHED).count()


def _first_publish_after(moment: datetime) -> float:
    """Seconds from ``moment`` to the first event the relay marked PUBLISHED after it."""
    first = OutboxEvent.objects.filter(published_at__gte=moment).aggregate(Min("published_at"))
    return float((first["published_at__min"] - moment).total_seconds())


def _errors_seen() -> set[str]:
    """The kinds of publish errors the events waiting for a retry carry now."""
    errors = OutboxEvent.objects.exclude(last_error="").values_list("last_error", flat=True)
    return {error.split(":")[0] for error in errors.distinct()}


def _assert_delivered_once_at_least(
    deliveries: list[Delivery], committed: set[str], rolled_back: AbstractSet[str] = frozenset()
) -> None:
    delivered = {delivery.message_id for delivery in deliveries}
    missing = committed - delivered
    assert not missing, f"{len(missing)} committed events never reached the queue"
    assert not delivered & rolled_back, "an event of a rolled-back transaction was published"
    assert not delivered - committed, "the queue holds events no test transaction committed"


def test_broker_stopped_and_crashed_mid_relay_loses_no_committed_event(
    rabbit: RabbitNode, sink: tuple[str, str]
) -> None:
    exchange, queue = sink
    relay = RelayProcess(rabbit.url, exchange, lease_seconds=60, name="relay")
    load = Load(threads=3, pause=0.02)
    try:
        relay.wait_started()
        load.start()
        time.sleep(3)
        before_outage = OutboxEvent.objects.filter(status=Status.PUBLISHED).count()
        # A clean shutdown: the relay's connection is closed by the broker.
        stopped = rabbit.restart_after("stop", down_seconds=3)
        errors = _errors_seen()
        time.sleep(3)
        # A crash: the socket just dies, with a batch possibly awaiting its confirms.
        crashed = rabbit.restart_after("crash", down_seconds=3)
        recovered, recovered_at = time.monotonic(), timezone.now()
        errors |= _errors_seen()
        time.sleep(2)
        load.stop()
        assert not load.errors, load.errors
        drained = wait_until(lambda: _unpublished() == 0, timeout=120, what="the outbox to drain")
        drain_after_recovery = time.monotonic() - recovered
        assert relay.alive(), relay.tail()  # recovered on its own: the same process throughout
        stats = relay.stats()
    except BaseException:
        load.stop()
        print(relay.tail())
        raise
    finally:
        relay.terminate()
        relay.close()

    committed, rolled_back = set(load.committed), load.rolled_back
    events = OutboxEvent.objects.all()
    # Exactly the committed events are in the outbox, all PUBLISHED, none leased or DEAD.
    assert set(map(str, events.values_list("event_id", flat=True))) == committed
    assert not events.filter(~Q(status=Status.PUBLISHED) | Q(relay_token__isnull=False)).exists()
    # The outages were seen: some publishes failed and were retried.
    assert stats["failed"] > 0, stats
    assert stats["dead"] == 0, stats

    deliveries = consume_all(rabbit.url, queue)
    _assert_delivered_once_at_least(deliveries, committed, rolled_back)
    # Keyed events: the first delivery of each keeps the order its key's events were written in.
    first_seq: dict[str, list[int]] = defaultdict(list)
    seen: set[str] = set()
    for delivery in deliveries:
        if delivery.message_id not in seen and delivery.body["key"]:
            first_seq[delivery.body["key"]].append(delivery.body["seq"])
        seen.add(delivery.message_id)
    for key, seqs in first_seq.items():
        assert seqs == sorted(seqs), f"key {key} delivered out of order: {seqs}"

    figures(
        "broker outages",
        transactions=load.transactions,
        committed_events=len(committed),
        rolled_back_events=len(rolled_back),
        published_before_first_outage=before_outage,
        deliveries=len(deliveries),
        duplicates=duplicates(deliveries),
        clean_stop_outage=str(stopped),
        crash_outage=str(crashed),
        first_publish_after_last_recovery_s=_first_publish_after(recovered_at),
        drain_after_last_recovery_s=drain_after_recovery,
        wait_for_drain_after_load_s=drained,
        relay_failed_publishes=stats["failed"],
        relay_published=stats["published"],
        retried_events=OutboxEvent.objects.filter(attempts__gt=0).count(),
        most_attempts=max(events.values_list("attempts", flat=True)),
        errors=sorted(errors),
    )


def _no_other_outbox_statement() -> bool:
    """No other session is running a statement on the outbox table (PostgreSQL)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
            "AND datname = current_database() AND pid <> pg_backend_pid() AND query ILIKE %s",
            [f"%{OutboxEvent._meta.db_table}%"],
        )
        return int(cursor.fetchone()[0]) == 0


def _commit_backlog(count: int, keys: int) -> set[str]:
    """``count`` committed events, half keyed over ``keys`` keys, fifty per transaction."""
    from django.db import transaction

    ids: set[str] = set()
    for start in range(0, count, 50):
        with transaction.atomic():
            for n in range(start, min(start + 50, count)):
                key = f"k{n % keys}" if n % 2 else None
                event = publish("rel.backlog", {"n": n, "key": key or ""}, key=key)
                ids.add(str(event.event_id))
    return ids


@pytest.mark.parametrize(
    ("take_over", "lease"),
    [
        pytest.param("true", 60.0, id="lock-says-gone"),
        pytest.param("false", 6.0, id="lease-runs-out"),
    ],
)
def test_relay_sigkilled_mid_batch_is_taken_over_by_its_lock_or_after_its_lease(
    rabbit: RabbitNode, sink: tuple[str, str], take_over: str, lease: float
) -> None:
    """With ``TAKE_OVER_DEAD_OWNERS`` the batch's session lock dies with the relay and the
    successor takes the batch at once, long before its 60 s lease; without it (a pooler that
    breaks session locks) the successor waits for the lease, and not a moment less."""
    exchange, queue = sink
    setting = {"IDEMPOTENCY_TEST_TAKE_OVER_DEAD_OWNERS": take_over}
    committed = _commit_backlog(3000, keys=10)
    orphans: dict[int, datetime | None] = {}
    attempts = 0
    killed_at = 0.0
    sent_unacked = 0
    published = OutboxEvent.objects.filter(status=Status.PUBLISHED)
    claimed = OutboxEvent.objects.filter(relay_token__isnull=False)
    with Connection(rabbit.url) as connection:
        channel = connection.default_channel

        def depth() -> int:
            return int(channel.queue_declare(queue=queue, passive=True).message_count)

        # Once the relay is in its stride, kill it when the queue holds more messages than
        # there are PUBLISHED events: a batch has reached the broker and is not acknowledged
        # in the database yet. Should the ack win the race (no batch left claimed), start
        # another relay and try again: the backlog is far from drained.
        while not orphans:
            attempts += 1
            assert attempts <= 5, "never caught the relay with a batch claimed"
            name = f"doomed-{attempts}"
            first = RelayProcess(rabbit.url, exchange, lease_seconds=lease, name=name, **setting)
            try:
                first.wait_started()
                floor = published.count() + 200

                def progressed(floor: int = floor) -> bool:
                    return published.count() >= floor

                wait_until(progressed, timeout=60, what="progress")
                # Should that moment be too short to catch, settle for a claimed batch.
                patience = time.monotonic() + 2

                def caught(patience: float = patience) -> bool:
                    in_flight = depth() > published.count()
                    return in_flight or (time.monotonic() > patience and claimed.exists())

                wait_until(caught, timeout=30, what="a batch in flight", every=0.001)
                first.kill()
                killed_at = time.monotonic()
                # A statement the relay sent just before it died still runs, and commits: an
                # acknowledgement read as not yet made would look like a batch sent again by
                # its successor before the lease ran out. Read the batch once it has settled.
                wait_until(_no_other_outbox_statement, timeout=10, what="the last statement")
                orphans = dict(claimed.values_list("pk", "locked_until"))
                sent_unacked = depth() - published.count()
            finally:
                first.close()
    published_by_first = OutboxEvent.objects.filter(status=Status.PUBLISHED).count()

    second = RelayProcess(rabbit.url, exchange, lease_seconds=lease, name="successor", **setting)
    try:
        second.wait_started()
        orphaned = OutboxEvent.objects.filter(pk__in=orphans)
        takeover = wait_until(
            lambda: not orphaned.exclude(status=Status.PUBLISHED).exists(),
            timeout=120,
            what="the orphaned batch to be published",
        )
        takeover_after_kill = time.monotonic() - killed_at
        drained = wait_until(lambda: _unpublished() == 0, timeout=120, what="the backlog")
        assert second.alive(), second.tail()
    except BaseException:
        print(second.tail())
        raise
    finally:
        second.terminate()
        second.close()

    for pk, published_at in orphaned.values_list("pk", "published_at"):
        lease_end = orphans[pk]
        assert published_at is not None and lease_end is not None
        if take_over == "true":  # taken by the lock, long before the lease let it go
            assert published_at < lease_end - timedelta(seconds=lease / 2)
        else:  # no orphan was sent again before the dead relay's lease ran out
            assert published_at >= lease_end
    assert not OutboxEvent.objects.exclude(status=Status.PUBLISHED).exists()
    assert not OutboxEvent.objects.filter(relay_token__isnull=False).exists()

    deliveries = consume_all(rabbit.url, queue)
    _assert_delivered_once_at_least(deliveries, committed)
    # What the dead relay had sent but not acknowledged went out again, with the same ids.
    assert duplicates(deliveries) >= sent_unacked
    orphan_ids = set(map(str, orphaned.values_list("event_id", flat=True)))
    orphan_copies = sum(1 for delivery in deliveries if delivery.message_id in orphan_ids)
    figures(
        f"relay SIGKILL ({'lock' if take_over == 'true' else 'lease'})",
        events=len(committed),
        kill_attempts=attempts,
        orphaned_batch=len(orphans),
        orphans_already_in_queue_at_kill=sent_unacked,
        published_before_kill=published_by_first,
        lease_s=lease,
        orphans_published_s_after_kill=takeover_after_kill,
        successor_wait_s=takeover,
        backlog_drained_s_later=drained,
        deliveries=len(deliveries),
        duplicates=duplicates(deliveries),
        orphan_deliveries=orphan_copies,
    )
