"""A sweep skips its run while the previous one still holds the work: two sweeps at once, on
two connections in two threads, and a sweep whose session died holds nothing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.db import session_locks
from django_idempotency.models import ProcessedMessage
from django_idempotency.operations.sweeps import sweep_processed_messages
from tests.support.factories import session_id, wait_until_session_ends

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not session_locks.enabled("default"),
        reason="SQLite has no session locks: overlapping sweeps stay correct, only wasteful",
    ),
]

OLD = 30


@pytest.fixture
def old_markers() -> None:
    at = timezone.now() - timedelta(days=30)
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="old", message_id=str(n), processed_at=at) for n in range(OLD)
    )


@pytest.fixture
def first_sweep_held() -> Iterator[tuple[threading.Event, threading.Event, dict[str, Any]]]:
    """A sweep in another thread (its own connection), stopped after its first batch until
    ``release`` is set; ``held`` is set once it stops."""
    held, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def pause(sender: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "first-sweep" and not held.is_set():
            held.set()
            assert release.wait(30)

    def first() -> None:
        try:
            outcome["count"] = sweep_processed_messages(batch_size=10)
        finally:
            connections.close_all()

    signals.rows_swept.connect(pause)
    thread = threading.Thread(target=first, name="first-sweep")
    thread.start()
    try:
        assert held.wait(30), "the first sweep did not start"
        yield held, release, outcome
    finally:
        release.set()
        thread.join(30)
        signals.rows_swept.disconnect(pause)


def test_a_sweep_skips_while_the_previous_one_holds_the_work(
    old_markers: None, first_sweep_held: Any, caplog: Any
) -> None:
    _, release, outcome = first_sweep_held
    left = ProcessedMessage.objects.count()
    assert left == OLD - 10  # the first batch committed
    with caplog.at_level(logging.INFO, logger="django_idempotency.operations.sweeps"):
        assert sweep_processed_messages(batch_size=10) is None
    assert ProcessedMessage.objects.count() == left  # it deleted nothing
    assert "skipped the processed_messages sweep: the previous one still holds" in caplog.text
    out = StringIO()
    call_command("idempotency_sweep", "--only", "messages", stdout=out)
    assert "messages: skipped, the previous sweep still runs" in out.getvalue()
    release.set()
    deadline = timezone.now() + timedelta(seconds=30)
    while "count" not in outcome and timezone.now() < deadline:
        threading.Event().wait(0.05)
    assert outcome["count"] == OLD
    # Once it is done the next run is not skipped.
    assert sweep_processed_messages(batch_size=10) == 0


def test_other_sweeps_are_not_held_back(old_markers: None, first_sweep_held: Any) -> None:
    from django_idempotency.operations.sweeps import sweep_expired_records

    assert sweep_expired_records() == 0


def test_a_sweep_whose_session_ended_holds_nothing(old_markers: None) -> None:
    """A worker killed mid-sweep: its connection closes, and the lock goes with it."""
    started = threading.Event()
    sessions: list[int] = []

    def dies_holding_the_lock() -> None:
        with session_locks.sweep("default", "processed_messages") as held:
            assert held
            sessions.extend(session_id(connection))
            started.set()
            connection.close()  # the session ends without letting go
        assert connection.connection is None  # and nothing opened another to let go

    thread = threading.Thread(target=dies_holding_the_lock)
    thread.start()
    thread.join(30)
    assert started.is_set()
    for session in sessions:  # the server lets go a moment after the client closed
        wait_until_session_ends(session)
    assert sweep_processed_messages() == OLD
