"""What the replay floors read, kept the cheapest way a layer could keep it, and their seeding.

A floor is only a floor if it does no less than a layer must: it reads the request's own key
under a scope, finds a stored answer of a real one's size that has not expired, and fails (a
500) when it finds none, so a run whose seeding went wrong cannot pass as fast. And it does no
more than a layer must: the Redis client keeps its connection (no pool checkout per command),
and the database read is a server-side prepared statement on a unique ``(scope, key)`` index,
read in binary. ``benchmarks.run`` seeds exactly the keys the floor rows send (:func:`seed`).
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Iterable
from typing import Any

import redis
from django.conf import settings
from django.db import connection

from benchmarks.benchproject import counting

#: Every floor key's scope: the caller, as a layer scopes keys (one caller here).
SCOPE = "user:1"
#: A stored answer with its headers (330 bytes, about a note's): what both replay floors read.
STORED_ANSWER = (b'{"id":1,"title":"bench","body":"a note","done":false}' * 7)[:330]
#: The database floor's read: by scope and key, on their unique index, the expiry in the WHERE.
READ = (
    "SELECT status, body FROM bench_notes_floorrecord "
    "WHERE scope = %s AND key = %s AND expires_at > now()"
)
#: psycopg prepares nothing on a connection whose threshold is None (Django's default); with
#: this one only the statements that ask (``prepare=True``) are prepared.
_ONLY_WHEN_ASKED = 2**31 - 1
_local = threading.local()


def redis_key(key: str) -> str:
    return f"bench:floor:{SCOPE}:{key}"


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
    """A psycopg cursor binding on the server, kept with this thread's connection (opened
    again after a reconnection); Django's own cursors bind on the client and prepare nothing."""
    import psycopg
    from psycopg.pq import Format

    connection.ensure_connection()
    raw = connection.connection
    kept = getattr(_local, "cursor", None)
    if kept is None or kept.connection is not raw:
        if raw.prepare_threshold is None:
            raw.prepare_threshold = _ONLY_WHEN_ASKED
        kept = _local.cursor = psycopg.Cursor(raw)
        kept.format = Format.BINARY  # the body comes back as bytes, not as hex to decode
    return kept


def read_record(key: str) -> tuple[int, bytes] | None:
    """The stored answer under ``key``, if it has not expired: one prepared statement."""
    cursor = _cursor()
    cursor.execute(READ, (SCOPE, key), prepare=True)
    counting.add()  # outside Django's cursor, so its statement counter does not see it
    row: tuple[int, bytes] | None = cursor.fetchone()
    return row


def execute(sql: str, params: tuple[Any, ...]) -> Any:
    """``sql`` as one prepared statement on this thread's connection (the first-time floor's
    claim and completion, prepared as a layer's are); the cursor, to fetch from."""
    cursor = _cursor()
    cursor.execute(sql, params, prepare=True)
    counting.add()
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


def seed(keys: Iterable[str]) -> None:
    """A stored answer under each of ``keys``, in the floor table and in Redis, expiring in a
    day: what the replay floors read."""
    from benchmarks.benchproject.notes.models import FloorRecord

    keys = list(keys)
    expires_at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    FloorRecord.objects.bulk_create(
        [
            FloorRecord(scope=SCOPE, key=key, expires_at=expires_at, status=201, body=STORED_ANSWER)
            for key in keys
        ],
        ignore_conflicts=True,
    )
    with redis.Redis.from_url(settings.REDIS_URL).pipeline(transaction=False) as pipeline:
        for key in keys:
            pipeline.set(redis_key(key), STORED_ANSWER, ex=86400)
        pipeline.execute()
