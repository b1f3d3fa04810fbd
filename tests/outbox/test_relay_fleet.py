"""Relays that share one outbox, each a process of its own: they split the keys between them,
and a relay killed mid-batch leaves its batch and its share of the keys to the others.

What they sent is read back from one file they all append to (tests/support/crash_publisher.py), in
the order they sent it, each line tagged with the relay that sent it.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from django.db import connection, transaction

from django_idempotency.db.session_locks import fleet
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from tests.support.outbox_support import database_env, spawned, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor == "sqlite", reason="SQLite has one writer and no session locks"
    ),
]

KEYS = 40
PER_KEY = 15
RELAY = [sys.executable, "-m", "django", "outbox_relay", "--loop", "--sleep", "0.05"]


def publish_backlog() -> dict[str, tuple[int, str]]:
    """KEYS × PER_KEY keyed events, the keys interleaved; ``{event id: (pk, key)}``."""
    for start in range(0, KEYS * PER_KEY, 200):
        with transaction.atomic():
            for n in range(start, start + 200):
                publish("orders.paid", {"n": n}, key=f"account-{n % KEYS}")
    return {
        str(event_id): (pk, key)
        for event_id, pk, key in OutboxEvent.objects.values_list("event_id", "pk", "key")
    }


def relay_env(sent: Path, tag: str, *, hold: Path | None = None) -> dict[str, str]:
    return {
        **database_env(),
        "DJANGO_SETTINGS_MODULE": "tests.support.settings_relay_file",
        "REL_SENT_FILE": str(sent),
        "REL_TAG": tag,
        "REL_HOLD_FILE": str(hold or ""),
        # The lease is far longer than the test: only presence can move a batch or a share.
        "REL_LEASE_SECONDS": "300",
    }


def sent_lines(sent: Path) -> list[tuple[str, str]]:
    if not sent.exists():
        return []
    return [tuple(line.split()) for line in sent.read_text().splitlines()]  # type: ignore[misc]


def all_published() -> bool:
    return not OutboxEvent.objects.exclude(status=OutboxEvent.Status.PUBLISHED).exists()


def first_sends_in_key_order(lines: list[tuple[str, str]], events) -> None:
    """Per key, the first send of each event follows id order (a repeat of an event already
    sent, allowed by at-least-once, is not an overtaking)."""
    seen: set[str] = set()
    last: dict[str, int] = {}
    for _, event_id in lines:
        if event_id in seen:
            continue
        seen.add(event_id)
        pk, key = events[event_id]
        assert pk > last.get(key, 0), f"{key}: event {pk} sent after a later one"
        last[key] = pk
    assert seen == set(events), f"{len(set(events) - seen)} events never sent"


def test_two_relays_share_the_keys_and_send_each_event_once_in_key_order(tmp_path):
    sent = tmp_path / "sent"
    with spawned(RELAY, relay_env(sent, "a")), spawned(RELAY, relay_env(sent, "b")):
        wait_for(lambda: fleet(connection.alias) == 2, what="both relays to hold a seat")
        time.sleep(1.5)  # each relay looks at the seats once a second: both now know of two
        events = publish_backlog()
        wait_for(all_published, what="the outbox to drain")
    lines = sent_lines(sent)
    first_sends_in_key_order(lines, events)
    assert len(lines) == len(events), "an event was sent twice with both relays alive"
    share = Counter(tag for tag, _ in lines)
    # Both relays worked, and each key went to one of them only.
    assert share["a"] > 0 and share["b"] > 0, share
    keys_of = {tag: {events[event_id][1] for t, event_id in lines if t == tag} for tag in share}
    assert not keys_of["a"] & keys_of["b"], "a key was sent by both relays"


def test_a_killed_relays_batch_and_share_move_to_the_other_relay(tmp_path):
    events = publish_backlog()
    sent = tmp_path / "sent"
    hold = tmp_path / "hold"
    hold.touch()
    with spawned(RELAY, relay_env(sent, "a", hold=hold)) as doomed:
        # Relay "a" sends the first wave of its first batch and stops there, unacknowledged.
        wait_for(lambda: sent_lines(sent), what="relay a's first wave")
        with spawned(RELAY, relay_env(sent, "b")):
            wait_for(lambda: fleet(connection.alias) == 2, what="both relays to hold a seat")
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(30)
            wait_for(all_published, what="relay b to take everything over")
    lines = sent_lines(sent)
    first_sends_in_key_order(lines, events)
    sent_by_a = {event_id for tag, event_id in lines if tag == "a"}
    repeats = [event_id for event_id, times in Counter(e for _, e in lines).items() if times > 1]
    # Only what "a" had sent without acknowledging went out again, with the same ids.
    assert set(repeats) <= sent_by_a
    assert Counter(tag for tag, _ in lines)["b"] >= len(events) - len(sent_by_a)


def test_a_stuck_relays_share_waits_at_most_a_lease():
    """A relay that holds its seat but sends nothing (a publisher that hangs) keeps its share of
    the keys from the others only until those events have been due for a whole lease."""
    from datetime import timedelta

    from django.db import connections
    from django.db.models import F

    from django_idempotency.db.session_locks import take_seat
    from django_idempotency.outbox.relay import Relay
    from django_idempotency.publishers.memory import broker
    from tests.support.outbox_support import published_ids

    broker.clear()
    stuck = connections.create_connection(connection.alias)
    try:
        assert take_seat(stuck) is not None  # a relay that runs, and never claims
        events = publish_backlog()
        with Relay(lease_seconds=15, share_keys=True) as relay:
            first = relay.drain()
            assert 0 < first.published < len(events), "the live relay took only its share"
            left = OutboxEvent.objects.exclude(status=OutboxEvent.Status.PUBLISHED)
            assert relay.drain().published == 0  # the rest is the stuck relay's, for now
            left.update(created_at=F("created_at") - timedelta(seconds=16))
            relay._seating.next_look = 0.0
            assert relay.drain().published == len(events) - first.published
        assert sorted(published_ids()) == sorted(events)
    finally:
        stuck.close()
        broker.clear()


def test_a_relay_that_only_drains_takes_no_seat():
    """The on-commit kick and the Celery task drain once: no seat, no connection for one."""
    from django_idempotency.outbox.relay import Relay

    publish_backlog()
    with Relay() as relay:
        relay.drain()
        assert fleet(connection.alias) == 0
    assert all_published()


@pytest.mark.django_db(transaction=True, databases=["default", "records"])
def test_relays_of_another_database_on_the_server_are_not_counted():
    """Seats are a database's: the relays of another database on the same server (another
    service's outbox, another test run) are no part of this outbox's fleet, whereas the server
    shows every database's advisory locks (PostgreSQL) and ``GET_LOCK`` names are the server's
    (MariaDB/MySQL)."""
    from django_idempotency.db.session_locks import Seat, seat_connection, take_seat

    elsewhere, here = seat_connection("records"), seat_connection(connection.alias)
    try:
        assert take_seat(elsewhere) == Seat(number=0, rank=0, fleet=1)
        assert fleet(connection.alias) == 0
        assert take_seat(here) == Seat(number=0, rank=0, fleet=1)
        assert fleet(connection.alias) == fleet("records") == 1
    finally:
        elsewhere.close()
        here.close()
