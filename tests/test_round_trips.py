"""Statements per path, counted, so that an extra round trip fails the build.

PostgreSQL: a first-time claim is one statement (it also takes the owner lock), a replay one
statement, the completion one (it also lets go of the owner lock), a 409 two (the claim, and
asking whether the owner is still there). MariaDB and SQLite read first and insert only when
the key is absent: on SQLite a duplicate must get its 409 from a read, never wait on the first
request's write lock, and on MariaDB the read keeps a replay at one statement; MariaDB takes and
releases its owner lock in statements of their own.
"""

from __future__ import annotations

import contextlib

import pytest
from django.db import connection, transaction
from django.http import HttpResponse

from django_idempotency.core import types
from django_idempotency.request import lifecycle
from tests.factories import held_elsewhere

pytestmark = pytest.mark.django_db(transaction=True)

FIRST_CLAIM = {"postgresql": 1, "sqlite": 2, "mysql": 3}
REPLAY = {"postgresql": 1, "sqlite": 1, "mysql": 1}
COMPLETION = {"postgresql": 1, "sqlite": 1, "mysql": 2}
CONFLICT = {"postgresql": 2, "sqlite": 1, "mysql": 2}
# Django logs the business transaction's BEGIN and COMMIT too.
BEGIN_COMMIT = 2


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
    from django_idempotency.inbox import consume_once
    from django_idempotency.models import FailedMessage

    with pytest.raises(RuntimeError), consume_once("billing", key):
        raise RuntimeError("handler failed")
    assert FailedMessage.objects.for_message("billing", key).exists()
    first = FIRST_DELIVERY[connection.vendor] + BEGIN_COMMIT
    with django_assert_num_queries(first) as captured, consume_once("billing", key) as consumption:
        assert consumption
    assert not any("SAVEPOINT" in sql for sql in statements(captured))
    # The failure record went with the handling commit, in the insert's statement or after it.
    assert not FailedMessage.objects.for_message("billing", key).exists()
    duplicate = DUPLICATE_DELIVERY[connection.vendor] + BEGIN_COMMIT
    with django_assert_num_queries(duplicate), consume_once("billing", key) as consumption:
        assert not consumption


@pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's parse cache")
def test_the_claim_is_parsed_once_not_on_every_request():
    """psycopg keeps its parse of a statement's placeholders only for statements up to
    ``MAX_CACHED_STATEMENT_LENGTH`` (4 KiB); a longer claim would be parsed again, in Python,
    on every request. Every variant of the claim fits, and a second claim is a cache hit."""
    from psycopg import _queries

    from django_idempotency.request import store

    for owner_lock in (True, False):
        for own_transaction in (True, False):
            text = store._postgresql_claim_text("default", owner_lock, own_transaction)
            assert len(text.encode()) <= _queries.MAX_CACHED_STATEMENT_LENGTH, len(text)
    lifecycle.claim(identity("parse-once-1"))
    hits = _queries._query2pg.cache_info().hits
    lifecycle.claim(identity("parse-once-2"))
    assert _queries._query2pg.cache_info().hits > hits
