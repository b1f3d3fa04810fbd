"""Record a published batch's outcomes, fenced on the batch's token, and when it is retried.

Every change is fenced on ``relay_token``: a relay whose lease ran out, and whose events another
relay has claimed since, changes nothing. The events were then published twice with the same
``event_id``, which consumers deduplicate. On PostgreSQL the acknowledgement is one statement,
the batch's relay lock let go inside it (``db.postgresql.outbox_ack_statement``); elsewhere one
short transaction, the lock let go after it.

A failed event waits a backoff (:func:`backoff_delay`) measured by the database's clock, or is
DEAD after its last attempt; a failure that says nothing about the event (an unreachable broker,
a route that is wrong) never makes it DEAD. The events queued behind it on its key are set aside
(HELD) in the same transaction, and released by the one that publishes it (holding.py).
"""

from __future__ import annotations

import contextlib
import functools
import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.db import DatabaseError, connections, transaction
from django.db.models import Field

from django_idempotency.conf import conf
from django_idempotency.core.failures import (
    FailureKind,
    describe,
    failure_fingerprint,
    failure_kind,
    failure_traceback,
)
from django_idempotency.db import postgresql, prepared, rows, session_locks
from django_idempotency.db.querysets import OutboxEventQuerySet, OutboxStatus
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.clock import DatabaseClock
from django_idempotency.outbox.holding import KeyChanges
from django_idempotency.outbox.publish import NOTIFY_CHANNEL
from django_idempotency.outbox.report import RelayStats

__all__ = ["Acknowledged", "Failure", "acknowledge", "backoff_delay"]


def backoff_delay(attempts: int, rng: random.Random | None = None) -> float:
    """Seconds before retry number ``attempts``: exponential with full jitter.

    Uniform over ``[0, min(max, base * 2 ** (attempts - 1))]``, so relays retrying a broker that
    just came back spread out instead of arriving together.
    """
    ceiling = min(
        conf.OUTBOX_BACKOFF_MAX_SECONDS,
        conf.OUTBOX_BACKOFF_BASE_SECONDS * 2 ** min(max(attempts - 1, 0), 62),
    )
    return (rng or random).uniform(0, ceiling)


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed event, its error, and the columns its acknowledgement sets (by field name)."""

    event: OutboxEvent
    error: BaseException
    changes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Acknowledged:
    """What an acknowledgement recorded, once it committed: the events it changed (still this
    relay's), updated in memory, and the batch's counts but those the announcement adds."""

    sent: list[OutboxEvent]
    failures: list[Failure]
    stats: RelayStats
    now: datetime


#: What the acknowledgement sets on a published event besides ``published_at``.
_SENT: dict[str, Any] = {
    "status": OutboxStatus.PUBLISHED,
    "last_error": "",
    "failure_fingerprint": None,
    "failing_since": None,
    "failure_traceback": None,
    "failure_kind": None,
}


def acknowledge(
    outbox: OutboxEventQuerySet,
    events: list[OutboxEvent],
    outcomes: dict[int, BaseException | None],
    clock: DatabaseClock,
    rng: random.Random,
    *,
    wake: bool = False,
) -> Acknowledged:
    """Record the batch's outcomes where this relay still holds the events, release what it
    did not try, and let go of the batch's lock. With ``wake``, the listening relays are
    woken when it changed any event (PostgreSQL, ``OUTBOX_NOTIFY``; inside the statement, so
    it costs no round trip): one may have found the batch's keys held and gone to sleep.

    Nothing is written on the events in memory until that committed: a batch whose
    acknowledgement failed is acknowledged again from the same events."""
    using = outbox.db
    now = clock.now()
    token = events[0].relay_token
    sent = [event for event in events if event.pk in outcomes and outcomes[event.pk] is None]
    failures = _failures(
        [(event, error) for event in events if (error := outcomes.get(event.pk)) is not None],
        now,
        rng,
    )
    untried = [event.pk for event in events if event.pk not in outcomes]
    keys = KeyChanges.after(sent, ((f.event, f.changes) for f in failures), now)
    if connections[using].vendor == "postgresql":
        notify = wake and conf.OUTBOX_NOTIFY
        # The events behind the batch's keys change in the same transaction (holding.py); a
        # batch with no failure, now or before, stays one statement in autocommit.
        with transaction.atomic(using=using) if keys else contextlib.nullcontext():
            owned = _ack_in_one_statement(using, token, now, sent, failures, untried, notify)
            keys.apply(outbox, owned, now)
    else:
        owned = _ack_in_a_transaction(outbox, token, now, sent, failures, untried, keys)
    stats = RelayStats(claimed=len(events))
    stats.lost = sum(1 for event in events if event.pk in outcomes and event.pk not in owned)
    stats.released = sum(1 for pk in untried if pk in owned)
    sent = [event for event in sent if event.pk in owned]
    failures = [failure for failure in failures if failure.event.pk in owned]
    for failure in failures:
        for name, value in failure.changes.items():
            setattr(failure.event, name, value)
    return Acknowledged(sent, failures, stats, now)


def _failures(
    failed: list[tuple[OutboxEvent, BaseException]], now: datetime, rng: random.Random
) -> list[Failure]:
    """What each failure changes: an attempt more, the error and its failure group, and a
    backoff, or DEAD after the last attempt."""
    max_attempts = conf.OUTBOX_MAX_ATTEMPTS
    # A batch often shares one error (a broker outage): describe it once.
    described: dict[int, tuple[str, str, str | None, FailureKind]] = {}
    failures = []
    for event, error in failed:
        if id(error) not in described:
            described[id(error)] = (
                describe(error),
                failure_fingerprint(error),
                failure_traceback(error) or None,
                failure_kind(error),
            )
        last_error, fingerprint, traceback, kind = described[id(error)]
        attempts = event.attempts + 1
        status, next_attempt_at = event.status, event.next_attempt_at
        if kind == FailureKind.CONFIGURATION:
            # Refused by the broker, or a route that is wrong: nothing the event did, and
            # nothing a quick retry mends. It waits the backoff's ceiling every time, never
            # dies of it, and goes out once a person fixed the route (or retried it).
            next_attempt_at = now + timedelta(seconds=conf.OUTBOX_BACKOFF_MAX_SECONDS)
        elif attempts >= max_attempts and kind != FailureKind.UNREACHABLE:
            status = OutboxStatus.DEAD
        else:
            # An unreachable broker says nothing about the event either: however long the
            # outage, the event waits for the broker (backoff capped) instead of dying.
            next_attempt_at = now + timedelta(seconds=backoff_delay(attempts, rng))
        changes = {
            "status": status,
            "attempts": attempts,
            "next_attempt_at": next_attempt_at,
            "last_error": last_error,
            "failure_fingerprint": fingerprint,
            # The failure group's clock: it restarts when the event fails for a new reason.
            "failing_since": (
                now
                if fingerprint != event.failure_fingerprint or event.failing_since is None
                else event.failing_since
            ),
            "last_failed_at": now,
            "failure_traceback": traceback,
            "failure_kind": kind.value,
        }
        failures.append(Failure(event, error, changes))
    return failures


def _ack_in_one_statement(
    using: str,
    token: uuid.UUID | None,
    now: datetime,
    sent: list[OutboxEvent],
    failures: list[Failure],
    untried: list[int],
    notify: bool,
) -> set[int]:
    """PostgreSQL: every outcome and the lock's release (and with ``notify`` the NOTIFY) in
    one statement, in autocommit (``db.postgresql.outbox_ack_statement``); the ids of the
    events it changed."""
    connection = connections[using]
    relay_lock = session_locks.enabled(using) and token is not None
    outcome_rows: list[tuple[int, str, dict[str, Any]]] = [
        *((event.pk, postgresql.ACK_SENT, _SENT) for event in sent),
        *((failure.event.pk, postgresql.ACK_FAILED, failure.changes) for failure in failures),
        *((pk, postgresql.ACK_UNTRIED, {}) for pk in untried),
    ]
    params: dict[str, Any] = {
        "id": _array_text([pk for pk, _, _ in outcome_rows]),
        "kind": _array_text([kind for _, kind, _ in outcome_rows]),
        "now": now,
        "token": token,
    }
    for name in postgresql.ACK_COLUMNS:
        params[name] = _array_text([changes.get(name) for _, _, changes in outcome_rows])
    if relay_lock:
        assert token is not None
        params["relay_lock"] = session_locks.lock_id(token)
    with prepared.cursor(connection) as cursor:
        cursor.execute(_ack_statement(using, relay_lock, notify), params)
        changed = cursor.fetchone()[0]
    return set(changed)


#: Strings that go into an array's text as they are: the outcome kinds and the statuses.
_BARE_WORDS = frozenset(
    {postgresql.ACK_SENT, postgresql.ACK_FAILED, postgresql.ACK_UNTRIED, *OutboxStatus.values}
)


def _array_text(values: list[Any]) -> str | list[Any]:
    """PostgreSQL's text form of an array of ids, kinds, statuses and NULLs (what a batch with
    no failure sends), which the statement casts to the column's array type; any other list
    as it is, for psycopg. psycopg looks at every element of a list to choose its type: for a
    batch's dozen arrays of 500, more time than the statement's own round trip."""
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
        elif type(value) is int:
            parts.append(str(value))
        elif isinstance(value, str) and value in _BARE_WORDS:  # statuses are str subclasses
            parts.append(value)
        else:
            return values
    return "{" + ",".join(parts) + "}"


def _ack_in_a_transaction(
    outbox: OutboxEventQuerySet,
    token: uuid.UUID | None,
    now: datetime,
    sent: list[OutboxEvent],
    failures: list[Failure],
    untried: list[int],
    keys: KeyChanges,
) -> set[int]:
    """MariaDB, MySQL and SQLite: one short transaction of several statements, then the
    lock let go; the ids of the events it changed."""
    using = outbox.db
    mine = outbox.filter(relay_token=token)
    with transaction.atomic(using=using):
        batch = [event.pk for event in sent] + [f.event.pk for f in failures] + untried
        owned = set(mine.select_for_update().filter(pk__in=batch).values_list("pk", flat=True))
        if sent_ids := [event.pk for event in sent if event.pk in owned]:
            mine.filter(pk__in=sent_ids).update(
                **_SENT, published_at=now, locked_until=None, relay_token=None
            )
        for failure in failures:
            if failure.event.pk in owned:
                mine.filter(pk=failure.event.pk).update(
                    **failure.changes, locked_until=None, relay_token=None
                )
        if untried:
            mine.filter(pk__in=untried).update(locked_until=None, relay_token=None)
        keys.apply(outbox, owned, now)
    if session_locks.enabled(using) and token is not None:
        # After the commit: until then the batch's rows still carry the token. A lock lost
        # with a broken connection needs no letting go.
        with contextlib.suppress(DatabaseError):
            session_locks.let_go_of_batch(using, token)
    return owned


@functools.lru_cache(maxsize=16)
def _ack_statement(using: str, relay_lock: bool, notify: bool) -> str:
    """The acknowledgement's text: it depends only on the connection, so it is built once."""
    connection = connections[using]
    types = {
        name: str(_field(name).cast_db_type(connection))
        for name in ("id", "published_at", *postgresql.ACK_COLUMNS)
    }
    return postgresql.outbox_ack_statement(
        rows.quoted_table(connection, OutboxEvent),
        functools.partial(rows.quoted_column, connection, OutboxEvent),
        types,
        relay_lock=relay_lock,
        notify_channel=NOTIFY_CHANNEL if notify else None,
    )


def _field(name: str) -> Field[Any, Any]:
    return cast("Field[Any, Any]", OutboxEvent._meta.get_field(name))
