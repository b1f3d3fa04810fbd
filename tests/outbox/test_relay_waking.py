"""A relay loop never idles while events it could claim wait: after a pass that claimed events it
passes again at once, a relay that found only heads another relay held wakes on that relay's
acknowledgement (a NOTIFY), and one whose event failed wakes when it falls due, not on its poll.

Every loop here polls only every 300 s, so only the behaviour under test can publish in time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, connections

from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.report import RelayStats
from django_idempotency.publishers.memory import broker
from tests.support.outbox_support import (
    CeilingRandom,
    publish_committed,
    settings_with,
    wait_for,
)

pytestmark = pytest.mark.django_db(transaction=True)
postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's"
)


@pytest.fixture(autouse=True)
def empty_broker() -> Iterator[None]:
    broker.clear()
    yield
    broker.clear()


class HeldRelay:
    """A relay (``batch_size`` 2) in a thread that claims a batch and holds it, published but
    not acknowledged, until :meth:`release`."""

    def __init__(self) -> None:
        self.claimed, self._release, self.done = (threading.Event() for _ in range(3))
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with Relay(batch_size=2) as relay:
                publish = relay._publish

                def publish_then_hold(events: list[OutboxEvent], deadline: float) -> Any:
                    outcomes = publish(events, deadline)
                    self.claimed.set()
                    self._release.wait(30)
                    return outcomes

                relay._publish = publish_then_hold  # type: ignore[method-assign]
                relay.run_once()
        finally:
            self.done.set()
            connections.close_all()

    def start(self) -> None:
        self._thread.start()
        assert self.claimed.wait(30)

    def release(self) -> None:
        self._release.set()
        assert self.done.wait(30)
        self._thread.join(30)

    def __enter__(self) -> HeldRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()  # also when the test failed: no thread outlives it


@contextmanager
def relay_loop(
    relay: Relay,
    passes: list[RelayStats],
    *,
    poll_seconds: float = 300,
    note: Callable[[RelayStats], None] | None = None,
) -> Iterator[None]:
    """``relay.run_forever`` in a thread, polling every ``poll_seconds``, each pass's stats
    noted (and given to ``note``, in the loop's thread); until the block ends, once its first
    pass is done."""
    stop, first = threading.Event(), threading.Event()

    def on_pass(stats: RelayStats) -> None:
        if note is not None:
            note(stats)
        passes.append(stats)
        first.set()

    def loop() -> None:
        try:
            relay.run_forever(stop, poll_seconds=poll_seconds, on_pass=on_pass)
        finally:
            relay.close()
            connections.close_all()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        assert first.wait(30)
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def sent_ids() -> list[Any]:
    return [message.event_id for message in broker.snapshot()]


def found_held_heads_then_waited(*, wake: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Three events of one key; another relay holds the first two while a lone relay loop looks
    and finds nothing it may claim; then the holder acknowledges. What was published 3 s later
    (the loop's poll is 300 s away)."""
    if not wake:
        monkeypatch.setattr(Relay, "_not_alone", lambda self: False)
    events = [publish_committed(payload={"n": n}, key="account-1") for n in range(3)]
    passes: list[RelayStats] = []
    with HeldRelay() as holder, relay_loop(Relay(), passes):
        # The race happened: the loop's first pass came while the heads were held.
        assert passes[0].claimed == 0
        assert sent_ids() == [events[0].event_id, events[1].event_id]
        holder.release()
        if wake:
            wait_for(lambda: len(broker.snapshot()) == 3, timeout=10, what="the third event")
        else:
            threading.Event().wait(3)
    return sent_ids()


@postgresql_only
def test_a_relay_that_found_held_heads_wakes_on_the_holders_acknowledgement(monkeypatch):
    sent = found_held_heads_then_waited(wake=True, monkeypatch=monkeypatch)
    assert sent == list(OutboxEvent.objects.order_by("pk").values_list("event_id", flat=True))


@postgresql_only
def test_control_without_the_acknowledgements_notify_the_loop_sleeps_on_its_poll(monkeypatch):
    """The guard above removed: the freed key's third event waits for the 300 s poll."""
    sent = found_held_heads_then_waited(wake=False, monkeypatch=monkeypatch)
    assert len(sent) == 2


@postgresql_only
def test_a_relay_loop_passes_again_at_once_after_a_pass_that_claimed_events(monkeypatch):
    """No NOTIFY at all from acknowledgements: the loop's pass claims another key's event while
    the first key's heads are held, and the holder acknowledges during that pass. The pass
    claimed less than a batch, yet the loop passes again at once and sends the freed key's
    third event."""
    monkeypatch.setattr(Relay, "_not_alone", lambda self: False)
    held = [publish_committed(payload={"n": n}, key="account-1") for n in range(3)]
    other = publish_committed(payload={"n": 9}, key="account-2")
    loop = Relay()
    publish: Callable[..., Any] = loop._publish

    def publish_once_the_holder_is_done(events: list[OutboxEvent], deadline: float) -> Any:
        if [event.pk for event in events] == [other.pk]:
            holder.release()
        return publish(events, deadline)

    loop._publish = publish_once_the_holder_is_done  # type: ignore[method-assign]
    passes: list[RelayStats] = []
    with HeldRelay() as holder, relay_loop(loop, passes):
        wait_for(lambda: len(broker.snapshot()) == 4, timeout=10, what="the freed key's event")
    assert passes[0].claimed == 1  # less than a batch: the old loop slept here
    assert sent_ids() == [held[0].event_id, held[1].event_id, other.event_id, held[2].event_id]


def failed_once_then_waited(*, wake: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """An event whose first attempt fails, with a backoff of exactly 1.5 s, relayed by a lone
    loop; what was published 3 s later (the loop's poll is 300 s away)."""
    if not wake:
        monkeypatch.setattr(Relay, "_sleep_at_most", lambda self, poll: poll)
    broker.fail_when(lambda message: message.attempt == 1)
    event = publish_committed(key="account-1")
    passes: list[RelayStats] = []
    with (
        # Seconds, not 0.5 s: the pass right after the failure must find the retry not yet
        # due, however late a loaded host runs it.
        settings_with(OUTBOX_BACKOFF_BASE_SECONDS=1.5),
        relay_loop(Relay(rng=CeilingRandom()), passes),
    ):
        if wake:
            wait_for(broker.snapshot, timeout=10, what="the retry")
        else:
            threading.Event().wait(3)
    assert passes[0].failed == 1
    assert all(stats.claimed == 0 for stats in passes[1:2])  # then nothing was due
    return [message.event_id for message in broker.snapshot() if message.event_id == event.event_id]


def test_a_relay_loop_wakes_when_an_event_it_failed_falls_due(monkeypatch):
    assert len(failed_once_then_waited(wake=True, monkeypatch=monkeypatch)) == 1


@postgresql_only  # polling relays back off from 50 ms after a busy pass and would find it anyway
def test_control_without_the_retry_deadline_the_loop_sleeps_on_its_poll(monkeypatch):
    assert failed_once_then_waited(wake=False, monkeypatch=monkeypatch) == []


def test_a_busy_loop_keeps_its_connection_and_lets_it_go_once_idle():
    """At ``CONN_MAX_AGE = 0`` a run of passes that claim events counts as one request: one
    connection for the run (a connection per batch cost more than the batch), a new one once
    the loop went idle."""
    assert connection.settings_dict["CONN_MAX_AGE"] == 0  # Django's default, as deployed
    for n in range(6):
        publish_committed(payload={"n": n})
    seen: list[tuple[int, Any]] = []
    relay = Relay(batch_size=2)

    def note(stats: RelayStats) -> None:
        seen.append((stats.claimed, connections[relay.using].connection))

    with relay_loop(relay, [], poll_seconds=0.2, note=note):
        wait_for(lambda: any(count == 0 for count, _ in seen), timeout=30, what="an idle pass")
        publish_committed(payload={"n": 6})
        wait_for(lambda: any(count == 1 for count, _ in seen), timeout=30, what="the pass after")
    claimed = [count for count, _ in seen]
    assert claimed[:4] == [2, 2, 2, 0], claimed
    busy = {id(raw) for count, raw in seen[:4]}
    assert len(busy) == 1  # the run of busy passes, and the pass that found nothing: one
    after_idle = next(raw for count, raw in seen if count == 1)
    assert after_idle is not seen[0][1]  # after the idle wait: a new connection
    assert len(broker.snapshot()) == 7
