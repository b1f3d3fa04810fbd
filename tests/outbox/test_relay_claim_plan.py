"""The relay's claim costs the same whenever the outbox's statistics were taken (PostgreSQL).

A queue's statistics are stale by nature: taken while it was empty, or during a deep backlog.
The claim's plan is pinned (``db.postgresql.PIN_OUTBOX_CLAIM_PLAN``) so that its per-key
subqueries walk their key's index range and stop at the first answer. What is measured is the
work the database reports (shared buffers touched, from ``EXPLAIN (ANALYZE, BUFFERS)``), not
time: the same on any machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from django_idempotency.db import postgresql
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import claim as claim_module
from django_idempotency.outbox.relay import Relay
from tests.support.outbox_support import CeilingRandom

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the plan pinned is PostgreSQL's"),
]

TABLE = OutboxEvent._meta.db_table
KEYS = 100
#: The plan before bitmap scans were turned off: only sorting and JIT.
UNGUARDED_PIN = "SELECT set_config('enable_sort', 'off', true), set_config('jit', 'off', true)"


def fill(pending: int, dead: int = 0, keys: int = KEYS) -> None:
    """``pending`` events on ``keys`` keys, interleaved, and ``dead`` DEAD events on keys of
    their own (a route that failed for good), in one statement each."""
    with connection.cursor() as cursor:
        for count, status, key in ((pending, "PENDING", "account-"), (dead, "DEAD", "dead-")):
            cursor.execute(
                f"INSERT INTO {TABLE} (event_id, topic, key, payload, headers, status, attempts, "
                "transaction_id, created_at, next_attempt_at, last_error) "
                "SELECT gen_random_uuid(), 'orders.paid', %s || (n %% %s), "
                "jsonb_build_object('n', n), '{}', %s, 0, 0, now() - interval '1 minute', "
                "now() - interval '1 minute', '' "
                "FROM generate_series(1, %s) AS n",
                [key, keys, status, count],
            )


def analyze() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}")


def wait_until_no_other_snapshot(timeout: float = 60.0) -> None:
    """Wait until no other session of this database holds a snapshot (an autovacuum's ANALYZE
    of the rows just written, say): until then, what a scan finds dead may still be visible to
    it, and the scan cannot mark its index entries dead."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT string_agg(backend_type || ': ' || left(query, 80), '; ') "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL"
            )
            (holders,) = cursor.fetchone()
            if holders is None:
                return
            assert time.monotonic() < deadline, f"snapshots held for {timeout} s: {holders}"
            time.sleep(0.1)


def claim_statement(relay: Relay) -> tuple[str, Any]:
    """The statement the relay's next claim runs, and its parameters (nothing is claimed)."""
    captured: list[tuple[str, Any]] = []
    real = claim_module.postgresql.fetch_outbox_claim

    def capture(connection: Any, statement: str, params: Any) -> list[tuple[Any, ...]]:
        captured.append((statement, params))
        return [(timezone.now(), None, None)]  # no batch

    claim_module.postgresql.fetch_outbox_claim = capture  # type: ignore[assignment]
    try:
        relay._claim()
    finally:
        claim_module.postgresql.fetch_outbox_claim = real  # type: ignore[assignment]
    return captured[0]


def explain(relay: Relay, pin: str = postgresql.PIN_OUTBOX_CLAIM_PLAN) -> dict[str, Any]:
    """The plan of the relay's next claim under ``pin``, run (``ANALYZE``) and rolled back."""
    statement, params = claim_statement(relay)
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
        try:
            cursor.execute(pin)
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", params)
            plan: dict[str, Any] = cursor.fetchone()[0][0]["Plan"]
        finally:
            cursor.execute("ROLLBACK")
    return plan


def buffers(relay: Relay, pin: str = postgresql.PIN_OUTBOX_CLAIM_PLAN) -> tuple[int, int]:
    """How many events the claim would take, and the shared buffers it touches doing so, under
    ``pin``; rolled back."""
    plan = explain(relay, pin)
    claimed = next(node for node in walk(plan) if node.get("Subplan Name") == "CTE claimed")
    return claimed["Actual Rows"], plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]


def index_entries(relay: Relay, pin: str = postgresql.PIN_OUTBOX_CLAIM_PLAN) -> int:
    """How many index entries the claim's index scans returned, over all their loops. Index
    entries pack hundreds to a page, so a probe that reads its key's whole history shows here
    long before it shows in buffers."""
    return sum(
        int(node["Actual Rows"] * node["Actual Loops"])
        for node in walk(explain(relay, pin))
        if node["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Index Scan")
    )


def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from walk(child)


@pytest.fixture
def relay() -> Iterator[Relay]:
    with Relay() as relay:
        yield relay


@pytest.mark.parametrize("statistics", ["taken while empty", "taken with the backlog"])
def test_a_claim_on_100000_pending_events_reads_a_batchs_worth(relay, statistics):
    if statistics == "taken while empty":
        analyze()
    fill(100_000, dead=2_000)
    if statistics == "taken with the backlog":
        analyze()
    claimed, touched = buffers(relay)
    assert claimed == relay.batch_size
    # About 50 per event (the row, its lock, the per-key probes, the lease): a batch's worth,
    # not the backlog's.
    assert touched < 100 * relay.batch_size, touched


def test_a_claim_in_keys_25000_deep_reads_a_batchs_worth(relay):
    """Two keys 25,000 events deep: each candidate's test of the events before it ends at the
    candidate, instead of reading the rest of its key."""
    fill(50_000, keys=2)
    # Statistics of this table. Left with those of an earlier test's 100 shallow keys (and a
    # table the partition tests rebuilt), the planner has served these checks from the older
    # (key, status, ...) index, whose range does not end at the candidate (268,187 buffers).
    analyze()
    claimed, touched = buffers(relay)
    assert claimed == relay.batch_size
    assert touched < 100 * relay.batch_size, touched


def every_keys_head_leased(relay: Relay) -> None:
    """One real claim: a batch holding the first events of every key, so that the next claim
    finds nothing it may take and reads past every pending event."""
    events, _ = relay._claim()
    assert {event.key for event in events} == {f"account-{n}" for n in range(KEYS)}


def test_a_claim_that_finds_every_key_held_reads_each_pending_event_once(relay):
    fill(100_000, dead=2_000)
    every_keys_head_leased(relay)
    analyze()
    claimed, touched = buffers(relay)
    assert claimed == 0
    # A few buffers per pending event: its row, and its key's probe stopping at the held head.
    assert touched < 15 * 100_000, touched
    # Counted in entries, which the bitmap plan's longer probes show (see the control below).
    assert index_entries(relay) < 3 * 100_000


def test_control_with_bitmap_scans_allowed_the_held_claim_reads_each_keys_history():
    """The guard removed (bitmap scans allowed): the statistics of a deep backlog make each
    candidate's probe read every earlier event of its key, where the guarded probe stops at the
    first. Counted in index entries: on the outbox's roomy pages (fillfactor 40) the bitmap
    plan's extra entries cost only about twice the buffers, but 20 times the time."""
    with Relay() as relay:
        fill(100_000)
        every_keys_head_leased(relay)
        analyze()
        unguarded = index_entries(relay, pin=UNGUARDED_PIN)
        guarded = index_entries(relay)
    # Guarded: about one entry per pending event and its probe. Unguarded: half its key's
    # 1,000 events per probe.
    assert guarded < 3 * 100_000, guarded
    assert unguarded > 100 * 100_000, unguarded
    assert unguarded > 20 * guarded, (unguarded, guarded)


def every_keys_head_failed(relay: Relay) -> None:
    """One real pass whose publisher refuses everything: the first event of every key fails
    (a backoff of a second or more), and its acknowledgement sets aside what is behind it."""
    from django_idempotency.publishers.memory import broker

    broker.fail_when(lambda message: True)
    try:
        relay.rng = CeilingRandom()
        assert relay.run_once().failed == KEYS
    finally:
        broker.fail_when(None)
        broker.clear()


def test_a_claim_with_100000_events_behind_failed_ones_reads_only_the_failed_ones(
    relay, idempotency_settings
):
    """Blocked keys cost a claim nothing: the events behind the failed heads are HELD, out of
    the relay index's range of PENDING events, so the claim reads the 100 heads and stops."""
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=600)
    fill(100_000)
    every_keys_head_failed(relay)
    assert OutboxEvent.objects.held().count() == 100_000 - KEYS
    analyze()
    # The first scan after the set-aside steps over the index entries the events left as
    # PENDING, once, and marks them dead (as a vacuum would): from then on, claims read the
    # heads only. It can only once no other session may still see those entries' events.
    wait_until_no_other_snapshot()
    first = buffers(relay)
    claimed, touched = buffers(relay)
    assert claimed == 0
    assert touched < 20 * KEYS, (first, touched)


def test_control_not_set_aside_the_blocked_events_are_read_on_every_claim(
    monkeypatch, idempotency_settings
):
    """The guard removed (nothing set aside, as before HELD): each claim reads every event
    queued behind the failed heads."""
    from django_idempotency.outbox import holding

    monkeypatch.setattr(holding, "set_aside", lambda *args, **kwargs: 0)
    idempotency_settings(OUTBOX_BACKOFF_BASE_SECONDS=600)
    with Relay() as relay:
        fill(20_000)
        every_keys_head_failed(relay)
        analyze()
        claimed, touched = buffers(relay)
    assert claimed == 0
    assert touched > 20_000, touched


def updates() -> tuple[int, int]:
    """The outbox table's updates so far, and how many of them were HOT (no index entry
    written), from PostgreSQL's statistics, this session's flushed first."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass",
            [TABLE],
        )
        return cursor.fetchone()  # type: ignore[no-any-return]


def hot_claims(relay: Relay, events: int) -> float:
    """The share of ``events`` claims that were HOT updates, draining ``events`` fresh events
    (each is claimed once and acknowledged once; an acknowledgement changes the status, which
    indexes hold, so it is never HOT)."""
    fill(events)
    updated, hot = updates()
    assert relay.drain().published == events
    updated_after, hot_after = updates()
    assert updated_after - updated == 2 * events
    return (hot_after - hot) / events


def test_a_claim_writes_no_index_entry(relay):
    """Migration 0013's fillfactor keeps room on each page for the version a claim writes, and
    the claim changes no indexed column: its update is HOT, so a backlog's claims add nothing
    to the table's seven indexes."""
    assert hot_claims(relay, 2_000) > 0.95


def test_control_on_packed_pages_a_claim_writes_index_entries(relay):
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {TABLE} SET (fillfactor = 100)")
    try:
        assert hot_claims(relay, 2_000) < 0.5
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {TABLE} SET (fillfactor = {postgresql.OUTBOX_FILLFACTOR})")
