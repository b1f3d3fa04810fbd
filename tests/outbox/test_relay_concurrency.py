import random
import threading

import pytest
from django.db import connections, transaction

from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import settings_with

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.concurrency]


@pytest.fixture(autouse=True)
def clean():
    broker.clear()
    yield
    broker.clear()


def run_relays(count: int, *, batch_size: int, rounds: int = 2000) -> list[BaseException]:
    """``count`` relays in threads, each draining until nothing is left unpublished."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def relay_until_done() -> None:
        try:
            start.wait(30)
            with Relay(batch_size=batch_size, rng=random.Random()) as relay:
                for _ in range(rounds):
                    relay.drain()
                    if not OutboxEvent.objects.unpublished().exists():
                        return
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=relay_until_done) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return errors


def publish_many(count: int, keys: list[str]) -> None:
    with transaction.atomic():
        for n in range(count):
            key = keys[n % len(keys)] if keys else None
            publish("orders.paid", {"n": n}, key=key)


def test_two_relays_at_once_publish_each_event_exactly_once():
    publish_many(200, keys=[])
    assert run_relays(2, batch_size=10) == []
    ids = [message.event_id for message in broker.snapshot()]
    assert len(ids) == 200 and len(set(ids)) == 200
    assert set(ids) == set(OutboxEvent.objects.values_list("event_id", flat=True))
    assert OutboxEvent.objects.published().count() == 200


def test_relays_side_by_side_keep_per_key_order_with_failures():
    keys = ["a", "b", "c", "d"]
    publish_many(80, keys=keys)
    chance = random.Random(11)
    lock = threading.Lock()

    def flaky(message):
        with lock:
            return chance.random() < 0.3

    broker.fail_when(flaky)
    with settings_with(OUTBOX_BACKOFF_BASE_SECONDS=0.001, OUTBOX_BACKOFF_MAX_SECONDS=0.005):
        assert run_relays(3, batch_size=5) == []
    messages = broker.snapshot()
    assert len(messages) == 80 and len({m.event_id for m in messages}) == 80
    for key in keys:
        sequence = [m.payload["n"] for m in messages if m.key == key]
        assert sequence == sorted(sequence), (key, sequence)


def test_sweeps_running_at_once_delete_each_row_once():
    from datetime import timedelta

    from django.utils import timezone

    from django_idempotency.models import ProcessedMessage
    from django_idempotency.operations.partitions import INBOX, is_partitioned
    from django_idempotency.operations.sweeps import sweep_processed_messages

    if is_partitioned(layout=INBOX):
        pytest.skip("a partitioned inbox is left to retention; the sweep deletes nothing")

    old = timezone.now() - timedelta(days=365)
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="c", message_id=str(n), processed_at=old) for n in range(300)
    )
    counts: list[int] = []
    start = threading.Barrier(3)

    def sweep() -> None:
        try:
            start.wait(30)
            counts.append(sweep_processed_messages(batch_size=25))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=sweep) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    # A sweep that starts while another holds the work skips (None, its session lock); those
    # that ran deleted each row once between them.
    assert len(counts) == 3 and any(count is not None for count in counts)
    assert sum(count for count in counts if count is not None) == 300
    assert not ProcessedMessage.objects.exists()
