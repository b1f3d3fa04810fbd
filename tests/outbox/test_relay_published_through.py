"""A relay remembers, per key, the highest id it published and recorded itself, and its claims'
per-key checks read nothing below it (``outbox.claim.published_through``): there the key's
published events left dead index entries that only a vacuum removes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models import F

from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker
from tests.outbox.test_relay_claim_plan import TABLE, buffers
from tests.support.outbox_support import CeilingRandom, publish_committed

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def empty_broker() -> Iterator[None]:
    broker.clear()
    yield
    broker.fail_when(None)
    broker.clear()


def test_a_relay_remembers_only_what_it_published_and_recorded_itself():
    first, failing, behind = (publish_committed(payload={"n": n}, key="k") for n in range(3))
    broker.fail_when(lambda message: message.event_id == failing.event_id)
    with Relay(rng=CeilingRandom()) as relay:
        stats = relay.run_once()
        assert (stats.published, stats.failed) == (1, 1)
        # The failed event and the one behind it are below no bound: they still hold the key.
        assert relay._published == {"k": first.pk}

    # A batch another relay took over while this one published: recorded by the other relay.
    taken = publish_committed(payload={"n": 3}, key="j")
    slow = Relay(lease_seconds=60)
    claimed, clock = slow._claim()
    assert [event.pk for event in claimed] == [taken.pk]
    OutboxEvent.objects.filter(pk=taken.pk).update(
        locked_until=F("locked_until") - timedelta(seconds=61)
    )
    with Relay() as other:
        assert other.run_once().published == 1
        assert other._published == {"j": taken.pk}
    stats = slow._ack(claimed, slow._publish(claimed, deadline=float("inf")), clock)
    slow.close()
    assert stats.lost == 1 and slow._published == {}
    behind.refresh_from_db()
    assert behind.status != OutboxEvent.Status.PUBLISHED


def test_a_relay_remembers_the_keys_it_used_last():
    with Relay() as relay:
        for n in range(1005):
            relay._note_published([OutboxEvent(pk=n + 1, key=f"key-{n}")])
        relay._note_published([OutboxEvent(pk=5000, key="key-3")])
        assert len(relay._published) == 1000
        assert "key-0" not in relay._published and relay._published["key-3"] == 5000
        assert list(relay._published)[-1] == "key-3"


@pytest.fixture
def no_vacuum() -> Iterator[None]:
    """The outbox as on a host where vacuum has not run yet, whatever this one's autovacuum."""
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = false)")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {TABLE} RESET (autovacuum_enabled)")


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the one-statement claim's checks")
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "control-unbounded"])
def test_a_claim_reads_none_of_its_keys_published_history(no_vacuum, bounded):
    """Two keys 10,000 events deep, 8,000 of each published by the relay: the next claim's
    per-key checks stop at what the relay published. The control, with the relay's memory
    cleared, reads each key's published history, entry by dead entry."""
    from tests.outbox.test_relay_claim_plan import analyze, fill

    fill(20_000, keys=2)
    analyze()
    with Relay() as relay:
        while OutboxEvent.objects.published().count() < 16_000:
            assert relay.run_once().published
        if not bounded:
            relay._published.clear()
        claimed, touched = buffers(relay)
    assert claimed == relay.batch_size
    # Bounded: about 40 buffers per event claimed (the claim's scan still passes the dead
    # entries its own index keeps of the published events). Unbounded: about 2,000, each
    # check reading its key's 8,000 published events.
    if bounded:
        assert touched < 50 * relay.batch_size, touched
    else:
        assert touched > 500 * relay.batch_size, touched


@pytest.mark.parametrize("outcome", ["rolled-back", "committed"])
def test_a_relay_inside_a_transaction_remembers_only_what_committed(outcome):
    """A relay allowed inside the caller's transaction acknowledges in it: until that commits,
    nothing is published, so nothing may bound a later claim's checks."""
    event = publish_committed(payload={"n": 1}, key="k")
    with Relay(allow_in_transaction=True) as relay:
        try:
            with transaction.atomic():
                assert relay.run_once().published == 1
                assert relay._published == {}  # not before the outermost commit
                if outcome == "rolled-back":
                    raise _RollBack
        except _RollBack:
            pass
        if outcome == "rolled-back":
            assert relay._published == {}
            event.refresh_from_db()
            assert event.status == OutboxEvent.Status.PENDING
        else:
            assert relay._published == {"k": event.pk}


class _RollBack(Exception):
    pass
