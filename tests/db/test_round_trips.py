"""Statements per path, counted, so that an extra round trip fails the build.

PostgreSQL: a first-time claim is one statement (it also takes the owner lock), a replay one
statement, the completion one (it also lets go of the owner lock), a 409 two (the claim, and
asking whether the owner is still there); a key this process answered lately is read with a
plain SELECT instead of the claim statement, and claimed only if that read cannot answer it.
MariaDB and SQLite read first and insert only when the key is absent: on SQLite a duplicate
must get its 409 from a read, never wait on the first request's write lock, and on MariaDB the
read keeps a replay at one statement; MariaDB takes and releases its owner lock in statements of
their own.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.http import HttpResponse
from django.utils import timezone

from django_idempotency.core import types
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import lifecycle, memory
from tests.support.factories import held_elsewhere

pytestmark = pytest.mark.django_db(transaction=True)

FIRST_CLAIM = {"postgresql": 1, "sqlite": 2, "mysql": 3}
REPLAY = {"postgresql": 1, "sqlite": 1, "mysql": 1}
COMPLETION = {"postgresql": 1, "sqlite": 1, "mysql": 2}
CONFLICT = {"postgresql": 2, "sqlite": 1, "mysql": 2}
# Django logs the business transaction's BEGIN and COMMIT too.
BEGIN_COMMIT = 2
STORED = types.StoredResponse(status=201, headers=[], body=b"ok", retained=True)


def identity(key: str, fingerprint: str = "f" * 64) -> types.Identity:
    return types.Identity(scope="s", key=key, fingerprint=fingerprint, method="POST", path="/x")


def statements(captured) -> list[str]:
    return [query["sql"] for query in captured.captured_queries]


def test_first_claim(key, django_assert_num_queries):
    with django_assert_num_queries(FIRST_CLAIM[connection.vendor]):
        decision = lifecycle.claim(identity(key))
    assert isinstance(decision, types.Proceed)


def test_a_claim_of_its_own_commits_asynchronously_and_one_in_a_transaction_does_not(
    key, django_assert_num_queries
):
    """The claim's commit need not wait for the WAL flush (the business commit flushes it);
    inside a caller's transaction the setting would reach the caller's commit, so it is left
    out there. The crash that shows nothing is lost: tests/reliability/test_crash_durability.py."""
    if connection.vendor != "postgresql":
        pytest.skip("synchronous_commit is PostgreSQL's")
    with django_assert_num_queries(1) as captured:
        lifecycle.claim(identity(key))
    assert "set_config('synchronous_commit', 'off', true)" in statements(captured)[0]
    with transaction.atomic():
        with django_assert_num_queries(1) as captured:
            lifecycle.claim(identity(f"{key}-inside"))
        assert "synchronous_commit" not in statements(captured)[0]
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone() == ("on",)


def test_completion_is_one_update_in_the_business_transaction(key, django_assert_num_queries):
    decision = lifecycle.claim(identity(key))
    assert isinstance(decision, types.Proceed)
    with django_assert_num_queries(BEGIN_COMMIT + COMPLETION[connection.vendor]) as captured:
        lifecycle.run(decision.lease, lambda: HttpResponse(b"ok", status=201))
    assert "UPDATE" in statements(captured)[1].upper()


def test_replay(key, django_assert_num_queries):
    decision = lifecycle.claim(identity(key))
    lifecycle.run(decision.lease, lambda: HttpResponse(b"ok", status=201))
    with django_assert_num_queries(REPLAY[connection.vendor]):
        replay = lifecycle.claim(identity(key))
    assert isinstance(replay, types.Replay)


def test_conflict_and_mismatch_only_read(key, django_assert_num_queries):
    with held_elsewhere(identity(key)):
        with django_assert_num_queries(CONFLICT[connection.vendor]):
            assert isinstance(lifecycle.claim(identity(key)), types.Conflict)
        with django_assert_num_queries(REPLAY[connection.vendor]):
            assert isinstance(lifecycle.claim(identity(key, "0" * 64)), types.Mismatch)


def test_whole_request_through_the_mixin(client, key, django_assert_num_queries):
    # claim + the view's own INSERT + completion, and nothing else.
    vendor = connection.vendor
    with django_assert_num_queries(FIRST_CLAIM[vendor] + BEGIN_COMMIT + 1 + COMPLETION[vendor]):
        first = client.post("/api/widget/", {"name": "n"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == 201
    with django_assert_num_queries(REPLAY[vendor]):
        again = client.post("/api/widget/", {"name": "n"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert again["Idempotent-Replay"] == "true"


def _only_reads(statement: str) -> bool:
    return statement.startswith("SELECT") and not {"INSERT", "UPDATE", "DELETE"} & set(
        statement.upper().split()
    )


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the claim reads first elsewhere")
def test_a_key_answered_here_is_read_before_it_is_claimed(key, django_assert_num_queries):
    """A retry of a key this process completed or replayed is decided by one plain read, not
    the claim statement; one this process has not answered (another one did) by the claim
    statement, as a first-time key is. The answer is the same either way."""
    decision = lifecycle.claim(identity(key))
    assert isinstance(decision, types.Proceed)
    lifecycle.run(decision.lease, lambda: HttpResponse(b"ok", status=201))
    with django_assert_num_queries(REPLAY["postgresql"]) as captured:
        read = lifecycle.claim(identity(key))
    assert _only_reads(statements(captured)[0])
    memory.clear()  # as if another process had answered it
    with django_assert_num_queries(REPLAY["postgresql"]) as captured:
        claimed = lifecycle.claim(identity(key))
    assert statements(captured)[0].startswith("WITH inserted AS")
    assert isinstance(read, types.Replay) and isinstance(claimed, types.Replay)
    assert read.response == claimed.response
    assert read.response.body == b"ok"
    # The claim's replay noted the key: its next retry is read first again.
    with django_assert_num_queries(REPLAY["postgresql"]) as captured:
        assert isinstance(lifecycle.claim(identity(key)), types.Replay)
    assert _only_reads(statements(captured)[0])


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the claim reads first elsewhere")
def test_a_key_answered_here_and_held_or_mismatched_is_refused_from_the_read(
    key, django_assert_num_queries
):
    """A 409 and a 422 need no write either: the read decides them as the claim would (the
    409 still asks whether the owner is there)."""
    with held_elsewhere(identity(key)):
        memory.remember(identity(key), STORED, None)  # answered here before, say
        with django_assert_num_queries(CONFLICT["postgresql"]) as captured:
            assert isinstance(lifecycle.claim(identity(key)), types.Conflict)
        assert _only_reads(statements(captured)[0])
        with django_assert_num_queries(REPLAY["postgresql"]) as captured:
            assert isinstance(lifecycle.claim(identity(key, "0" * 64)), types.Mismatch)
        assert _only_reads(statements(captured)[0])


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the claim reads first elsewhere")
@pytest.mark.parametrize("since", ["expired", "released"])
def test_a_key_answered_here_that_expired_or_was_released_is_claimed_after_the_read(
    key, since, django_assert_num_queries
):
    """A key taken for answered that is not (any more) costs one read more, then is claimed
    as any first-time key: the hint chooses a statement, the database decides."""
    decision = lifecycle.claim(identity(key))
    assert isinstance(decision, types.Proceed)
    lifecycle.run(decision.lease, lambda: HttpResponse(b"ok", status=201))
    records = IdempotencyRecord.objects.filter(key=key)
    if since == "expired":
        records.update(expires_at=timezone.now() - timedelta(hours=1))
    else:
        records.delete()
    with django_assert_num_queries(1 + FIRST_CLAIM["postgresql"]) as captured:
        again = lifecycle.claim(identity(key))
    assert isinstance(again, types.Proceed)
    first, claim = statements(captured)
    assert _only_reads(first) and claim.startswith("WITH inserted AS")


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the claim reads first elsewhere")
def test_inside_a_transaction_a_key_answered_here_is_claimed_without_the_read(
    key, django_assert_num_queries
):
    """A caller's transaction may hold a snapshot older than the key's answer: the claim
    statement, which handles that, decides."""
    decision = lifecycle.claim(identity(key))
    assert isinstance(decision, types.Proceed)
    lifecycle.run(decision.lease, lambda: HttpResponse(b"ok", status=201))
    with transaction.atomic(), django_assert_num_queries(REPLAY["postgresql"]) as captured:
        assert isinstance(lifecycle.claim(identity(key)), types.Replay)
    assert statements(captured)[0].startswith("WITH inserted AS")


@pytest.mark.skipif(connection.vendor != "postgresql", reason="transaction ids are PostgreSQL's")
@pytest.mark.parametrize("path", ["replay", "conflict", "mismatch"])
def test_an_answer_that_needs_no_claim_writes_nothing(key, path):
    """A replay, a 409 and a 422 only read: the claim statement takes no row lock and no
    transaction id, so it writes no WAL and waits for no flush."""
    fingerprint = "0" * 64 if path == "mismatch" else "f" * 64
    with contextlib.ExitStack() as stack:
        if path == "replay":
            decision = lifecycle.claim(identity(key))
            lifecycle.run(decision.lease, lambda: HttpResponse(b"ok", status=201))
        else:
            stack.enter_context(held_elsewhere(identity(key)))
        # Forty answers: PostgreSQL logs a sequence's next 32 values at once, and the call
        # that logs takes a transaction id, so a claim that so much as advanced the id
        # sequence would show it at least once.
        answers = [_claim_in_a_fresh_transaction(identity(key, fingerprint)) for _ in range(40)]
    expected = {"replay": types.Replay, "conflict": types.Conflict, "mismatch": types.Mismatch}
    assert all(isinstance(answer, expected[path]) for answer, _ in answers)
    assigned = [xid for _, xid in answers if xid is not None]
    assert not assigned, "the claim wrote (took a transaction id) to answer a retry"


def _claim_in_a_fresh_transaction(ident: types.Identity) -> tuple[types.Decision, object]:
    """Claim inside a transaction of a connection of its own (nothing else ever ran in it),
    and return the answer with the transaction id the transaction took, if any."""
    import threading

    from django.db import transaction

    result: list[tuple[types.Decision, object]] = []

    def claim() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                answer = lifecycle.claim(ident)
                cursor.execute("SELECT pg_current_xact_id_if_assigned()")
                result.append((answer, cursor.fetchone()[0]))
        finally:
            connection.close()

    thread = threading.Thread(target=claim)
    thread.start()
    thread.join(60)
    assert result, "the claim did not finish"
    return result[0]


def _prepared_claims() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH inserted AS%%'"
        )
        return int(cursor.fetchone()[0])


@pytest.mark.parametrize("prepared", [True, False])
def test_the_claim_is_prepared_once_per_connection_unless_turned_off(
    key, prepared, idempotency_settings
):
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are used on PostgreSQL")
    idempotency_settings(PREPARED_STATEMENTS=prepared)
    for n in range(3):
        lifecycle.claim(identity(f"{key}-{n}"))
    assert _prepared_claims() == (1 if prepared else 0)


def test_a_column_added_to_the_table_does_not_break_a_prepared_claim(key):
    """The claim names the columns it returns, so a migration that adds one while connections
    keep the prepared statement changes nothing for them."""
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are used on PostgreSQL")
    before = lifecycle.claim(identity(f"{key}-before"))
    lifecycle.run(before.lease, lambda: HttpResponse(b"ok", status=201))
    table = connection.ops.quote_name("django_idempotency_idempotencyrecord")
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} ADD COLUMN added_later integer")
    try:
        assert isinstance(lifecycle.claim(identity(f"{key}-after")), types.Proceed)
        assert isinstance(lifecycle.claim(identity(f"{key}-before")), types.Replay)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} DROP COLUMN added_later")


# The inbox: the marker's insert (and, on PostgreSQL, the failure record's delete with it) is
# one statement; a duplicate is not an error, so no savepoint wraps it. Django logs the BEGIN and
# COMMIT of consume_once's own transaction.
FIRST_DELIVERY = {"postgresql": 1, "sqlite": 2, "mysql": 2}
DUPLICATE_DELIVERY = {"postgresql": 1, "sqlite": 1, "mysql": 1}


def test_the_inbox_marks_a_message_in_one_statement(key, django_assert_num_queries):
    from django_idempotency.conf import conf
    from django_idempotency.inbox import consume_once
    from django_idempotency.models import FailedMessage

    # On a partitioned inbox the message's lock comes first, a statement of its own.
    lock = int(conf.INBOX_PARTITIONS and connection.vendor == "postgresql")
    with pytest.raises(RuntimeError), consume_once("billing", key):
        raise RuntimeError("handler failed")
    assert FailedMessage.objects.for_message("billing", key).exists()
    first = FIRST_DELIVERY[connection.vendor] + BEGIN_COMMIT + lock
    with django_assert_num_queries(first) as captured, consume_once("billing", key) as consumption:
        assert consumption
    assert not any("SAVEPOINT" in sql for sql in statements(captured))
    # The failure record went with the handling commit, in the insert's statement or after it.
    assert not FailedMessage.objects.for_message("billing", key).exists()
    duplicate = DUPLICATE_DELIVERY[connection.vendor] + BEGIN_COMMIT + lock
    with django_assert_num_queries(duplicate), consume_once("billing", key) as consumption:
        assert not consumption


@pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's parse cache")
def test_the_claim_is_parsed_once_not_on_every_request():
    """psycopg keeps its parse of a statement's placeholders only for statements up to
    ``MAX_CACHED_STATEMENT_LENGTH`` (4 KiB); a longer claim would be parsed again, in Python,
    on every request. Every variant of the claim fits, and a second claim is a cache hit."""
    from psycopg import _queries

    from django_idempotency.request import claims

    for owner_lock in (True, False):
        for own_transaction in (True, False):
            text = claims._postgresql_claim_text("default", owner_lock, own_transaction)
            assert len(text.encode()) <= _queries.MAX_CACHED_STATEMENT_LENGTH, len(text)
    lifecycle.claim(identity("parse-once-1"))
    hits = _queries._query2pg.cache_info().hits
    lifecycle.claim(identity("parse-once-2"))
    assert _queries._query2pg.cache_info().hits > hits


# The outbox relay, its own transactions (BEGIN and COMMIT counted): on PostgreSQL a claim is one
# statement (the candidates, the per-key order check, the batch's relay lock and the lease) and
# so is an acknowledgement (every outcome, fenced on the relay token, and the lock let go).
# MariaDB and SQLite keep a short transaction: the claim reads the time (MariaDB), selects,
# looks for earlier events of the batch's keys left out, takes the lock (MariaDB) and leases;
# the acknowledgement locks the batch's rows, updates the sent, each failed event and the
# untried, and lets go of the lock (MariaDB).
RELAY_CLAIM = {"postgresql": 1, "mysql": 7, "sqlite": 5}
RELAY_ACK = {"postgresql": 1, "mysql": 9, "sqlite": 8}  # 1 sent, 3 failed, 1 untried


def _relay_locks_held() -> int | None:
    """The relay locks this session holds (PostgreSQL), or None where that is not asked."""
    if connection.vendor != "postgresql":
        return None
    from django_idempotency.db.postgresql import RELAY_LOCK_CLASS

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND pid = pg_backend_pid() AND classid = %s::oid AND objsubid = 2",
            [RELAY_LOCK_CLASS],
        )
        return int(cursor.fetchone()[0])


def _key_in_share(rank: int, fleet: int) -> str:
    """A key whose hash puts it in the share of the relay of ``rank`` among ``fleet``."""
    from django_idempotency.db import dialect

    key_hash = dialect(connection.alias).KEY_HASH if fleet > 1 else None
    for n in range(100):
        key = f"account-{n}"
        if key_hash is None:
            return key
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT ({key_hash}(%s) & 2147483647) %% %s", [key, fleet])
            if cursor.fetchone()[0] == rank:
                return key
    raise AssertionError("no key found")


@pytest.mark.parametrize(
    "fleet",
    [
        1,
        pytest.param(
            2, marks=pytest.mark.skipif(connection.vendor == "sqlite", reason="no seats on SQLite")
        ),
    ],
    ids=["alone", "sharing the keys"],
)
def test_a_relay_claim_and_its_acknowledgement_are_one_statement_each_on_postgresql(
    fleet, django_assert_num_queries, idempotency_settings
):
    """Counted with a batch of every kind: sent, failed, DEAD, failed by an outage, untried;
    alone, and sharing the keys (the share's query and the fallback's in the one statement).
    The other backends' counts are held too, so that they do not grow unnoticed."""
    from django.utils import timezone

    from django_idempotency.db import session_locks
    from django_idempotency.exceptions import BrokerUnavailable, PublishError
    from django_idempotency.models import OutboxEvent
    from django_idempotency.outbox.relay import Relay
    from tests.support.outbox_support import CeilingRandom, publish_committed

    vendor = connection.vendor
    idempotency_settings(OUTBOX_MAX_ATTEMPTS=3)
    key = _key_in_share(0, fleet)
    failing, held_back = publish_committed(key=key), publish_committed(key=key)
    sent, outage, dying = (publish_committed() for _ in range(3))
    OutboxEvent.objects.filter(pk__in=[outage.pk, dying.pk]).update(attempts=2)
    relay = Relay(rng=CeilingRandom())
    if fleet > 1:
        relay._seating.seat = session_locks.Seat(number=0, rank=0, fleet=fleet)

    with django_assert_num_queries(RELAY_CLAIM[vendor]) as captured:
        events, clock = relay._claim()
    assert [event.pk for event in events] == [
        failing.pk, held_back.pk, sent.pk, outage.pk, dying.pk
    ]  # fmt: skip
    token = events[0].relay_token
    assert token is not None and {event.relay_token for event in events} == {token}
    assert all(event.locked_until > clock.now() for event in events)
    assert _relay_locks_held() in (1, None), "the claim did not take the batch's relay lock"
    if vendor == "postgresql":
        # The plan is pinned in the same round trip, for the claim's transaction only.
        assert statements(captured)[0].startswith("SELECT set_config('enable_sort', 'off', true)")
        with connection.cursor() as cursor:
            cursor.execute("SHOW enable_sort")
            assert cursor.fetchone() == ("on",)

    outcomes: dict[int, BaseException | None] = {
        failing.pk: PublishError("refused"),
        sent.pk: None,
        outage.pk: BrokerUnavailable("down"),
        dying.pk: PublishError("refused"),
    }  # held_back: untried (its key failed first)
    with django_assert_num_queries(RELAY_ACK[vendor]):
        stats = relay._ack(events, outcomes, clock)
    counts = (stats.published, stats.failed, stats.dead, stats.released, stats.lost)
    assert counts == (1, 2, 1, 1, 0)
    assert _relay_locks_held() in (0, None), "the acknowledgement did not let go of the lock"
    rows = OutboxEvent.objects.in_bulk()
    assert {row.relay_token for row in rows.values()} == {None}
    assert {row.locked_until for row in rows.values()} == {None}
    assert rows[sent.pk].status == "PUBLISHED" and rows[sent.pk].published_at is not None
    assert rows[dying.pk].status == "DEAD" and rows[dying.pk].attempts == 3
    # An outage never kills an event, whatever its attempts.
    for pk, attempts, message in ((failing.pk, 1, "refused"), (outage.pk, 3, "down")):
        row = rows[pk]
        assert (row.status, row.attempts) == ("PENDING", attempts)
        assert message in row.last_error and row.failure_fingerprint
        assert row.next_attempt_at > timezone.now() and row.failing_since == row.last_failed_at
    assert (rows[held_back.pk].status, rows[held_back.pk].attempts) == ("PENDING", 0)
    assert rows[held_back.pk].last_failed_at is None


def test_an_acknowledgement_fenced_out_changes_nothing_in_its_one_statement(
    django_assert_num_queries,
):
    if connection.vendor != "postgresql":
        pytest.skip("MariaDB, MySQL and SQLite acknowledge in a short transaction")
    from django_idempotency.models import OutboxEvent
    from django_idempotency.outbox.relay import Relay
    from tests.support.outbox_support import publish_committed

    publish_committed(), publish_committed()
    relay = Relay()
    events, clock = relay._claim()
    OutboxEvent.objects.update(relay_token=uuid.uuid4())  # another relay took the batch over
    with django_assert_num_queries(1):
        stats = relay._ack(events, {event.pk: None for event in events}, clock)
    assert (stats.published, stats.lost) == (0, 2)
    assert not OutboxEvent.objects.published().exists()
    assert _relay_locks_held() == 0
