"""Every statement on the records table names its record's scope, so the table can be
distributed by scope (Citus, docs/sharding.md) with each request's statements routed to one
shard; the inbox's statements name the message id, its distribution column. The SQL of each path
is captured on this backend and read: a statement that reads or changes existing rows compares
the column with the request's value, once per place it names the table; an INSERT writes it."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.core import types
from django_idempotency.db import session_locks
from django_idempotency.inbox.consumers import consume_once
from django_idempotency.models import FailedMessage, IdempotencyRecord, ProcessedMessage
from django_idempotency.request import claims, store
from tests.support.factories import held_elsewhere

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = IdempotencyRecord._meta.db_table
STORED = types.StoredResponse(status=201, headers=[], body=b"ok", retained=True)


@pytest.fixture(autouse=True)
def values_in_the_sql(idempotency_settings: Any) -> None:
    """Prepared statements log ``$1`` where the value was: read the SQL with the values bound on
    the client instead. The statements are the same either way."""
    idempotency_settings(PREPARED_STATEMENTS=False)


@pytest.fixture
def scope() -> str:
    return f"shard-{uuid.uuid4().hex[:12]}"


def identity(scope: str, key: str, fingerprint: str = "f" * 64) -> types.Identity:
    return types.Identity(scope=scope, key=key, fingerprint=fingerprint, method="POST", path="/x")


def claimed(scope: str, key: str) -> types.Lease:
    decision = claims.claim(identity(scope, key), uuid.uuid4())
    assert isinstance(decision, types.Proceed), decision
    return decision.lease


def records_statements(action: Callable[[], Any], table: str = TABLE) -> list[str]:
    """The statements ``action`` sends that name ``table``."""
    with CaptureQueriesContext(connection) as captured:
        action()
    return [query["sql"] for query in captured.captured_queries if table in query["sql"]]


def assert_scoped(
    statements: list[str], scope: str, *, table: str = TABLE, column: str = "scope"
) -> None:
    """Each statement constrains ``column`` to ``scope`` wherever it reaches ``table``."""
    assert statements, f"the path sent no statement on {table}"
    named = rf"[\"`]?{table}[\"`]?"
    scoped = rf"[\"`]?{column}[\"`]?\s*=\s*'{re.escape(scope)}'"
    for sql in statements:
        # Each FROM / UPDATE / JOIN of the table reaches rows that already exist: each needs its
        # own condition on the column (the PostgreSQL claim has three, in one statement).
        reaching = len(re.findall(rf"\b(?:FROM|UPDATE|JOIN)\s+{named}", sql, re.IGNORECASE))
        assert len(re.findall(scoped, sql, re.IGNORECASE)) >= reaching, sql
        if re.match(rf"\s*(?:WITH .*?\()?INSERT INTO {named}", sql, re.IGNORECASE | re.DOTALL):
            columns = re.search(
                rf"INSERT INTO {named}(?:\s+AS\s+\w+)?\s*\(([^)]*)\)", sql, re.IGNORECASE
            )
            assert columns and re.search(rf"[\"`]?{column}[\"`]?\s*(,|$)", columns[1]), sql
            assert f"'{scope}'" in sql, sql


def expire_lease(key: str) -> None:
    IdempotencyRecord.objects.filter(key=key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=5)
    )


@pytest.mark.usefixtures("claim_path")
def test_a_first_claim(scope, key):
    assert_scoped(records_statements(lambda: claimed(scope, key)), scope)


@pytest.mark.usefixtures("claim_path")
def test_a_replay(scope, key):
    assert store.complete(claimed(scope, key), STORED)
    statements = records_statements(
        lambda: claims.claim(identity(scope, key), uuid.uuid4()) and None
    )
    assert_scoped(statements, scope)


@pytest.mark.usefixtures("claim_path")
def test_a_conflict_and_a_mismatch(scope, key):
    with held_elsewhere(identity(scope, key)):
        conflict = records_statements(lambda: claims.claim(identity(scope, key), uuid.uuid4()))
        other = identity(scope, key, "0" * 64)
        mismatch = records_statements(lambda: claims.claim(other, uuid.uuid4()))
    assert_scoped(conflict + mismatch, scope)


@pytest.mark.usefixtures("claim_path")
def test_a_takeover_after_the_lease_ran_out(scope, key):
    claimed(scope, key)
    expire_lease(key)
    taken: list[types.Decision] = []
    statements = records_statements(
        lambda: taken.append(claims.claim(identity(scope, key), uuid.uuid4()))
    )
    assert isinstance(taken[0], types.Proceed) and taken[0].lease.taken_over
    assert_scoped(statements, scope)


@pytest.mark.usefixtures("claim_path")
def test_an_expired_record_claimed_again(scope, key):
    assert store.complete(claimed(scope, key), STORED)
    IdempotencyRecord.objects.filter(key=key).update(
        expires_at=timezone.now() - timedelta(seconds=5)
    )
    again: list[types.Decision] = []
    statements = records_statements(
        lambda: again.append(claims.claim(identity(scope, key), uuid.uuid4()))
    )
    assert isinstance(again[0], types.Proceed) and not again[0].lease.taken_over
    assert_scoped(statements, scope)


@pytest.mark.usefixtures("claim_path")
def test_a_takeover_from_a_dead_owner(scope, key):
    if not session_locks.enabled(store.database_alias()):
        pytest.skip("owners hold session locks on PostgreSQL and MariaDB only")
    with held_elsewhere(identity(scope, key)):
        pass  # that request's connection is gone now, its lease still running
    taken: list[types.Decision] = []
    statements = records_statements(
        lambda: taken.append(claims.claim(identity(scope, key), uuid.uuid4()))
    )
    assert isinstance(taken[0], types.Proceed) and taken[0].lease.taken_over
    assert_scoped(statements, scope)


@pytest.mark.parametrize("step", ["complete", "extend", "release"])
def test_what_the_owner_does_with_its_record(scope, key, step):
    lease = claimed(scope, key)
    operation = {
        "complete": lambda: store.complete(lease, STORED),
        "extend": lambda: store.extend(lease),
        "release": lambda: store.release(lease),
    }[step]
    done: list[bool] = []
    statements = records_statements(lambda: done.append(operation()))
    assert done == [True]
    assert_scoped(statements, scope)


# --- the inbox, by message id -------------------------------------------------------------------


def test_the_inbox_names_the_message_id_in_every_statement(scope):
    """A first delivery, a failed one (its failure written down) and a duplicate."""
    message_id = f"message-{scope}"

    def fail() -> None:
        with pytest.raises(RuntimeError), consume_once("billing", message_id):
            raise RuntimeError("handler failed")

    def handle() -> None:
        with consume_once("billing", message_id) as consumption:
            assert consumption

    def duplicate() -> None:
        with consume_once("billing", message_id) as consumption:
            assert not consumption

    with CaptureQueriesContext(connection) as captured:
        fail(), handle(), duplicate()
    for table in (ProcessedMessage._meta.db_table, FailedMessage._meta.db_table):
        statements = [query["sql"] for query in captured.captured_queries if table in query["sql"]]
        assert_scoped(statements, message_id, table=table, column="message_id")
