"""What the replay floors read, kept the cheapest way a layer could keep it, and their seeding.

A floor is only a floor if it does no less than a layer must: it derives the key's scope from
the caller (a digest of the ``Authorization`` header, or the user DRF authenticated), reads the
request's own key under that scope, finds a stored answer of a real one's size that has not
expired with the fingerprint of the request that made it, reads the request's body and compares
its digest with that fingerprint (a reused key with another body must be refused, not
answered), fails (a 500) when it finds none, so a run whose seeding went wrong cannot pass as
fast, and runs its SQL through Django's cursor wrapper, as a layer inside Django must. And it
does no more than a layer must: the Redis client keeps its connection (no pool checkout per
command), and the database read is a server-side prepared statement on a unique ``(scope,
key)`` index, read in binary. ``benchmarks.run`` seeds exactly the keys the floor rows send
(:func:`seed`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import threading
from collections.abc import Iterable
from typing import Any

import redis
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections

#: A stored answer with its headers (330 bytes, about a note's): what both replay floors read.
STORED_ANSWER = (b'{"id":1,"title":"bench","body":"a note","done":false}' * 7)[:330]
#: The database floor's read: by scope and key, on their unique index, the expiry in the WHERE.
READ = (
    "SELECT status, fingerprint, body FROM bench_notes_floorrecord "
    "WHERE scope = %s AND key = %s AND expires_at > now()"
)
#: The length of :func:`fingerprint`'s digest, which a Redis value starts with.
FINGERPRINT_BYTES = 32
#: psycopg prepares nothing on a connection whose threshold is None (Django's default); with
#: this one only the statements that ask (``prepare=True``) are prepared.
_ONLY_WHEN_ASKED = 2**31 - 1
_local = threading.local()


def credentials_scope(request: Any) -> str:
    """The caller, as a layer that answers before any authentication knows it: one digest of
    its credentials (never the credentials themselves, which a store must not hold)."""
    return hashlib.sha256(request.META["HTTP_AUTHORIZATION"].encode()).hexdigest()


def user_scope(user: Any) -> str:
    """The caller, as a layer inside DRF's view knows it: the user DRF authenticated."""
    return f"user:{user.pk}"


def fingerprint(body: bytes) -> bytes:
    """The least a layer can compare a retry's body with: one digest of its bytes."""
    return hashlib.sha256(body).digest()


def redis_key(scope: str, key: str) -> str:
    return f"bench:floor:{scope}:{key}"


@functools.cache
def _redis_pool() -> redis.ConnectionPool:
    return redis.ConnectionPool.from_url(settings.REDIS_URL)


def redis_client() -> redis.Redis:
    """This thread's client, holding one connection for good: a command neither checks a
    connection out of the pool nor gives it back."""
    client: redis.Redis | None = getattr(_local, "redis", None)
    if client is None:
        client = _local.redis = redis.Redis(
            connection_pool=_redis_pool(), single_connection_client=True
        )
    return client


def _cursor() -> Any:
    """A psycopg cursor that binds on the server, kept with this thread's connection (opened
    again after a reconnection), lent through Django's own cursor wrapper as Django lends each
    of its cursors: a layer inside Django must let it check the connection's health, translate
    a database error (so that a broken connection is closed at the request's end) and run the
    project's execute wrappers (its instrumentation, ``assertNumQueries``). Django's own cursors
    bind on the client and prepare nothing."""
    from django.db.backends.utils import CursorWrapper
    from psycopg.pq import Format

    db = connections[DEFAULT_DB_ALIAS]  # this thread's, looked up once (not through the proxy)
    db.close_if_health_check_failed()
    db.ensure_connection()
    raw = db.connection
    kept = getattr(_local, "cursor", None)
    if kept is None or kept.cursor.connection is not raw:
        if raw.prepare_threshold is None:
            raw.prepare_threshold = _ONLY_WHEN_ASKED
        opened = _preparing()(raw)
        opened.format = Format.BINARY  # the body comes back as bytes, not as hex to decode
        kept = _local.cursor = CursorWrapper(opened, db)
    db.validate_thread_sharing()
    return kept


@functools.cache
def _preparing() -> type:
    """A psycopg cursor whose statements are prepared on the server."""
    import psycopg

    class Preparing(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
            return super().execute(query, params, prepare=True, **options)

    return Preparing


def read_record(scope: str, key: str) -> tuple[int, bytes, bytes] | None:
    """The stored answer under ``(scope, key)`` with its request's fingerprint, if it has not
    expired: one prepared statement."""
    cursor = _cursor()
    cursor.execute(READ, (scope, key))
    row: tuple[int, bytes, bytes] | None = cursor.fetchone()
    return row


def execute(sql: str, params: tuple[Any, ...]) -> Any:
    """``sql`` as one prepared statement on this thread's connection (the first-time floor's
    claim and completion, prepared as a layer's are); the cursor, to fetch from."""
    cursor = _cursor()
    cursor.execute(sql, params)
    return cursor


def prepared() -> bool:
    """Whether this connection holds :data:`READ` as a prepared statement (a setup check)."""
    with connection.connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement = %s",
            [READ.replace("%s", "$1", 1).replace("%s", "$2", 1)],
        )
        (count,) = cursor.fetchone()
    return bool(count)


def seed(keys: Iterable[tuple[str, str]], authorization: str) -> None:
    """A stored answer under each ``(key, body)`` of ``keys``, with that body's fingerprint,
    in the floor table and in Redis, expiring in a day, under both scopes a floor derives for
    the client that sends ``authorization`` (the credentials' digest; the benchmark's user):
    what the replay floors read."""
    from django.contrib.auth import get_user_model

    from benchmarks.benchproject.authentication import BENCH_USER
    from benchmarks.benchproject.notes.models import FloorRecord

    keys = list(keys)
    credentials = hashlib.sha256(authorization.encode()).hexdigest()
    scopes = (credentials, user_scope(get_user_model().objects.get(username=BENCH_USER)))
    expires_at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    FloorRecord.objects.bulk_create(
        [
            FloorRecord(
                scope=scope,
                key=key,
                expires_at=expires_at,
                status=201,
                fingerprint=fingerprint(body.encode()),
                body=STORED_ANSWER,
            )
            for scope in scopes
            for key, body in keys
        ],
        ignore_conflicts=True,
    )
    with redis.Redis.from_url(settings.REDIS_URL).pipeline(transaction=False) as pipeline:
        for scope in scopes:
            for key, body in keys:
                value = fingerprint(body.encode()) + STORED_ANSWER
                pipeline.set(redis_key(scope, key), value, ex=86400)
        pipeline.execute()
