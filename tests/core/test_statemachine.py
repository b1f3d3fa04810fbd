"""The rules of ``core/statemachine.py`` and ``core/leases.py``, exhaustively, and every other
form that states them (the lease rule's ORM and SQL forms, the claim on each backend, the
PostgreSQL statement) held equal to them with hypothesis."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_idempotency.core import leases
from django_idempotency.core.leases import expired_q, run_out_q, running_q
from django_idempotency.core.leases import running as lease_running
from django_idempotency.core.statemachine import (
    ACCEPTED,
    COMPLETED,
    HELD,
    PROCESSING,
    RecordState,
    Verdict,
    is_expired,
    judge,
    seconds_left,
)
from django_idempotency.core.types import Conflict, Identity, Mismatch, Proceed, Replay
from django_idempotency.db import database_now, session_locks
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import claims
from tests.support.factories import identity

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
MINE, OTHER = "f" * 64, "e" * 64

#: Offsets from "now", in seconds, kept away from 0 so that a boundary seldom falls between the
#: test's clock and a statement's (where one does, ``claim_as_the_rules_say`` sees it).
offsets = st.sampled_from([-90_000, -100, -31, -2, 2, 31, 100, 90_000])


@st.composite
def records(draw: st.DrawFn, now: datetime = NOW) -> RecordState:
    status = draw(st.sampled_from([PROCESSING, COMPLETED, ACCEPTED]))
    lease = None if status == COMPLETED else now + timedelta(seconds=draw(offsets))
    return RecordState(
        status=status,
        fingerprint=draw(st.sampled_from([MINE, OTHER])),
        lease_expires_at=lease,
        expires_at=now + timedelta(seconds=draw(offsets)),
    )


# --- the rules themselves -------------------------------------------------------------------------


def test_every_combination_has_the_designed_verdict():
    """DESIGN.md's table, row by row, over every status, lease, expiry and fingerprint."""
    past, future = NOW - timedelta(seconds=5), NOW + timedelta(seconds=5)
    for status, lease, expiry, fingerprint, owner_gone in itertools.product(
        [PROCESSING, COMPLETED, ACCEPTED],
        [None, past, future],
        [past, future],
        [MINE, OTHER],
        [False, True],
    ):
        if status == COMPLETED and lease is not None:
            continue  # a completed record has no lease
        record = RecordState(status, fingerprint, lease, expiry)
        running = status in (PROCESSING, ACCEPTED) and lease == future
        if expiry == past and not running:
            expected = Verdict.CLAIM  # absent: even another request may use the key
        elif fingerprint != MINE:
            expected = Verdict.MISMATCH
        elif status == COMPLETED:
            expected = Verdict.REPLAY
        elif running and status == ACCEPTED:
            # A worker holds it: replay the 202 (a worker's lease is never cut short).
            expected = Verdict.HANDED_OFF
        elif running:
            # A running lease is only cut short when its owner's session is gone.
            expected = Verdict.TAKE_OVER_DEAD_OWNER if owner_gone else Verdict.CONFLICT
        else:
            expected = Verdict.TAKE_OVER
        assert judge(record, MINE, NOW, owner_gone=owner_gone) is expected, record
    assert judge(None, MINE, NOW) is Verdict.CLAIM


@given(record=records())
def test_a_running_lease_is_never_expired_nor_taken_over(record: RecordState):
    if lease_running(record.status, record.lease_expires_at, NOW):
        assert not is_expired(record, NOW)
        expected = Verdict.HANDED_OFF if record.status == ACCEPTED else Verdict.CONFLICT
        assert judge(record, record.fingerprint, NOW) is expected


@given(seconds=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
def test_retry_after_is_whole_seconds_and_at_least_one(seconds: float):
    left = seconds_left(NOW + timedelta(seconds=seconds), NOW)
    assert left >= 1 and (seconds <= 0 or left >= seconds)
    assert seconds_left(None, NOW) == 1


# --- the filters state the same rules ---------------------------------------------------------


@pytest.mark.django_db
@hypothesis_settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(records(), min_size=1, max_size=8))
def test_the_querysets_select_what_the_rules_say(rows: list[RecordState]):
    IdempotencyRecord.objects.all().delete()
    stored = {}
    for record in rows:
        row = IdempotencyRecord.objects.create(
            scope="s", key=str(uuid.uuid4()), fingerprint=record.fingerprint,
            status=record.status, owner_token=uuid.uuid4(),
            lease_expires_at=record.lease_expires_at, method="POST", path="/",
            created_at=NOW, expires_at=record.expires_at,
        )  # fmt: skip
        stored[row.pk] = record
    records_ = IdempotencyRecord.objects.all()

    def selected(q) -> set[int]:
        return set(records_.filter(q).values_list("pk", flat=True))

    def by_rule(rule) -> set[int]:
        return {pk for pk, record in stored.items() if rule(record)}

    expired = by_rule(lambda r: is_expired(r, NOW))
    running = by_rule(lambda r: lease_running(r.status, r.lease_expires_at, NOW))
    run_out = by_rule(
        lambda r: r.status in HELD and not lease_running(r.status, r.lease_expires_at, NOW)
    )
    assert selected(expired_q(NOW)) == expired
    assert selected(running_q(NOW)) == running
    assert selected(run_out_q(NOW)) == run_out
    assert selected(claims._stale_q(NOW, MINE) & ~expired_q(NOW)) == by_rule(
        lambda r: judge(r, MINE, NOW) is Verdict.TAKE_OVER
    )
    # The SQL forms, in a plain statement as the claim and the partitions use them.
    assert selected_by_sql(leases.expired_sql) == expired
    assert selected_by_sql(leases.running_sql) == running
    assert selected_by_sql(leases.run_out_sql) == run_out


def selected_by_sql(condition) -> set[int]:
    quote = connection.ops.quote_name
    table = quote(IdempotencyRecord._meta.db_table)

    def column(name: str) -> str:
        return f"r.{quote(IdempotencyRecord._meta.get_field(name).column)}"

    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT r.{quote('id')} FROM {table} AS r WHERE {condition(column, '%(now)s')}",
            {"now": NOW},
        )
        return {row[0] for row in cursor.fetchall()}


# --- the claim, on every backend and both PostgreSQL paths ----------------------------


@pytest.mark.django_db(transaction=True)
@hypothesis_settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_claim_decides_what_the_rules_say(claim_path, data):
    """Whatever record a claim finds, its decision is the state machine's verdict, judged by
    the database's own clock; the PostgreSQL statement included."""
    now = database_now("default")
    ident = identity(fingerprint=MINE)
    claim_as_the_rules_say(ident, data.draw(records(now)), created_at=now)


#: The decision each verdict must give.
DECISION = {
    Verdict.CLAIM: Proceed,
    Verdict.TAKE_OVER: Proceed,
    Verdict.TAKE_OVER_DEAD_OWNER: Proceed,
    Verdict.REPLAY: Replay,
    Verdict.HANDED_OFF: Replay,
    Verdict.CONFLICT: Conflict,
    Verdict.MISMATCH: Mismatch,
}


def claim_as_the_rules_say(
    ident: Identity, record: RecordState, *, created_at: datetime
) -> Verdict:
    """Plant ``record`` under ``ident``'s key (created at ``created_at``), claim the key, and
    check the decision is the state machine's verdict, which it returns.

    The claim reads the database's clock once, somewhere between the two reads around it: the
    verdict is judged at both, and where a slow host let a boundary fall in between, the decision
    may be either one."""
    IdempotencyRecord.objects.create(
        scope=ident.scope, key=ident.key, fingerprint=record.fingerprint, status=record.status,
        owner_token=uuid.uuid4(), lease_expires_at=record.lease_expires_at, method="POST",
        path="/", created_at=created_at, expires_at=record.expires_at, attempts=3,
        response_status=None if record.status == PROCESSING else 201,
        response_body=None if record.status == PROCESSING else b"stored",
    )  # fmt: skip
    # Nobody holds the record's owner lock (it was written here, not claimed): where owners hold
    # locks, a running lease of a request that is gone is taken over at once.
    owner_gone = session_locks.enabled("default")
    before = database_now("default")
    decision = claims.claim(ident, uuid.uuid4())
    after = database_now("default")
    verdicts = {judge(record, MINE, at, owner_gone=owner_gone) for at in (before, after)}
    matching = [verdict for verdict in verdicts if _gives(verdict, decision)]
    assert matching, (record, verdicts, decision)
    return matching[0]


def _gives(verdict: Verdict, decision: object) -> bool:
    """Whether ``decision`` is what ``verdict`` must give."""
    if not isinstance(decision, DECISION[verdict]):
        return False
    if isinstance(decision, Proceed):
        taken_over = verdict in (Verdict.TAKE_OVER, Verdict.TAKE_OVER_DEAD_OWNER)
        return decision.lease.attempt == (4 if taken_over else 1)
    if isinstance(decision, Replay):
        return decision.response.body == b"stored" and decision.handed_off == (
            verdict is Verdict.HANDED_OFF
        )
    return True
