"""factory-boy factories for the app's models."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone
from factory.django import DjangoModelFactory

from django_idempotency.core.failures import FailureKind
from django_idempotency.core.types import Identity
from django_idempotency.db.querysets import ACCEPTED, COMPLETED, PROCESSING, OutboxStatus
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage


def _ago(seconds: float):
    return factory.LazyFunction(lambda: timezone.now() - timedelta(seconds=seconds))


class IdempotencyRecordFactory(DjangoModelFactory):
    """A COMPLETED record by default; traits ``stuck``, ``running``, ``expired`` and
    ``accepted``."""

    class Meta:
        model = IdempotencyRecord

    class Params:
        stuck = factory.Trait(
            status=PROCESSING,
            lease_expires_at=_ago(60),
            response_status=None,
            response_headers=[],
            response_body=None,
            completed_at=None,
        )
        running = factory.Trait(
            status=PROCESSING,
            lease_expires_at=_ago(-300),
            response_status=None,
            response_headers=[],
            response_body=None,
            completed_at=None,
        )
        expired = factory.Trait(created_at=_ago(3 * 86400), expires_at=_ago(3600))
        #: Handed to a worker (a 202 stored), held for another ten minutes.
        accepted = factory.Trait(
            status=ACCEPTED,
            lease_expires_at=_ago(-600),
            response_status=202,
            completed_at=None,
        )

    scope = "user:1"
    key = factory.Sequence(lambda n: f"key-{n:05d}")
    fingerprint = factory.LazyFunction(lambda: uuid.uuid4().hex * 2)
    status = COMPLETED
    owner_token = factory.LazyFunction(uuid.uuid4)
    lease_expires_at = None
    method = "POST"
    path = "/api/payments/"
    response_status = 201
    response_headers = factory.LazyFunction(lambda: [["Content-Type", "application/json"]])
    response_body = b'{"id": 1, "amount": "10.00"}'
    created_at = _ago(120)
    completed_at = factory.SelfAttribute("created_at")
    expires_at = _ago(-86400)


class OutboxEventFactory(DjangoModelFactory):
    """A PENDING event, due, never tried; traits ``published``, ``dead``, ``failing`` (pending
    a retry after two failures), ``misconfigured`` (the same, the broker refusing its route)
    and ``leased`` (a relay is publishing it)."""

    class Meta:
        model = OutboxEvent

    class Params:
        published = factory.Trait(status=OutboxStatus.PUBLISHED, published_at=_ago(60))
        dead = factory.Trait(
            status=OutboxStatus.DEAD,
            attempts=10,
            last_error="PublishError: the broker said no",
            failure_kind=FailureKind.OTHER,
        )
        failing = factory.Trait(
            attempts=2,
            next_attempt_at=_ago(-300),
            last_error="BrokerUnavailable: timed out",
            failure_kind=FailureKind.UNREACHABLE,
        )
        misconfigured = factory.Trait(
            attempts=2,
            next_attempt_at=_ago(-600),
            last_error="BrokerConfigurationError: NATS server refused the credentials",
            failure_kind=FailureKind.CONFIGURATION,
        )
        leased = factory.Trait(locked_until=_ago(-60), relay_token=factory.LazyFunction(uuid.uuid4))

    event_id = factory.LazyFunction(uuid.uuid4)
    topic = "orders.paid"
    key = ""
    payload = factory.LazyFunction(lambda: {"order_id": 1, "total": "10.00"})
    headers = factory.LazyFunction(dict)
    status = OutboxStatus.PENDING
    attempts = 0
    next_attempt_at = _ago(120)
    created_at = _ago(120)


class ProcessedMessageFactory(DjangoModelFactory):
    class Meta:
        model = ProcessedMessage

    consumer = "billing"
    message_id = factory.Sequence(lambda n: f"message-{n:05d}")
    processed_at = _ago(60)


class UserFactory(DjangoModelFactory):
    class Meta:
        model = get_user_model()

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("pw")


def identity(**overrides: Any) -> Identity:
    """A lifecycle-level request identity with a fresh key unless one is given."""
    values: dict[str, Any] = {
        "scope": "anonymous",
        "key": f"key-{uuid.uuid4()}",
        "fingerprint": "f" * 64,
        "method": "POST",
        "path": "/api/widget/",
    }
    values.update(overrides)
    return Identity(**values)


def age_record(scope: str, key: str, seconds: float, using: str = "default") -> None:
    """Move a record ``seconds`` into the past, as if that much database time had gone by.

    Leases and expiry are judged by the database's clock, which freezegun cannot move.
    """
    from datetime import timedelta

    from django.db.models import F

    from django_idempotency.models import IdempotencyRecord

    delta = timedelta(seconds=seconds)
    records = IdempotencyRecord.objects.using(using).filter(scope=scope, key=key)
    records.update(created_at=F("created_at") - delta, expires_at=F("expires_at") - delta)
    records.exclude(lease_expires_at=None).update(lease_expires_at=F("lease_expires_at") - delta)
    records.exclude(completed_at=None).update(completed_at=F("completed_at") - delta)


@contextlib.contextmanager
def held_elsewhere(ident: Identity) -> Iterator[Any]:
    """Claim ``ident`` from another thread, whose database connection (and so its owner lock)
    stays open until the block ends: a request that is still running somewhere else.

    A claim made on the test's own connection would not do where owners hold session locks:
    that session is the one asking, and a session always finds its own lock free.
    """
    from django.db import connection

    from django_idempotency.request import lifecycle

    claimed: list[Any] = []
    sessions: list[int] = []
    done = threading.Event()
    ready = threading.Event()

    def hold() -> None:
        try:
            sessions.extend(session_id(connection))
            claimed.append(lifecycle.claim(ident))
            ready.set()
            done.wait(60)
        finally:
            ready.set()
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert ready.wait(30) and claimed, "the other request could not claim"
        yield claimed[0]
    finally:
        done.set()
        thread.join(30)
        # The server ends the session, and lets go of its locks, a moment after the client
        # closed it: the block ends once the other request's session is gone.
        for session in sessions:
            wait_until_session_ends(session)


def session_id(connection: Any) -> list[int]:
    """The server's id of ``connection``'s session (none on SQLite)."""
    queries = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}
    if connection.vendor not in queries:
        return []
    with connection.cursor() as cursor:
        cursor.execute(queries[connection.vendor])
        return [int(cursor.fetchone()[0])]


def wait_until_session_ends(session: int) -> None:
    """Wait (10 s at most) until the server no longer lists ``session``."""
    import time

    from django.db import connection

    query = (
        "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
        if connection.vendor == "postgresql"
        else "SELECT 1 FROM information_schema.processlist WHERE id = %s"
    )
    deadline = time.monotonic() + 10
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            if connection.vendor == "postgresql":
                # Inside a transaction PostgreSQL keeps the first list it read: read afresh.
                cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(query, [session])
            if cursor.fetchone() is None:
                return
            time.sleep(0.01)
    raise AssertionError(f"the other request's session {session} did not end")
