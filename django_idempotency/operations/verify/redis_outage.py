"""The check that the Redis copy survives an outage: replays stay identical, new keys run once.

The outage is simulated in this process only: ``CACHE_ALIAS`` is pointed, for a moment, at a
copy of the project's cache settings whose ``LOCATION`` is a closed port. The project's Redis is
never restarted.
"""

from __future__ import annotations

import socket
from typing import Any

from django.conf import settings
from django.db import connections, router
from django.test.utils import CaptureQueriesContext, override_settings

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations.verify.client import Requests, scratch_view
from django_idempotency.operations.verify.results import Result, VerifyOptions
from django_idempotency.operations.verify.scratch import PREFIX, Scratch
from django_idempotency.request import redis_copy

__all__ = ["redis_outage"]

_OUTAGE_ALIAS = "idempotency_verify_outage"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_outage(scratch: Scratch) -> Result:
    """Replays from Redis, then with Redis unreachable, then with Redis back."""
    name = "Redis copy survives an outage"
    alias = conf.CACHE_ALIAS
    if alias is None:
        return Result(name, None, "CACHE_ALIAS is None: no Redis to lose")
    from django_redis import get_redis_connection

    requests = Requests(scratch, VerifyOptions())
    records = connections[router.db_for_write(IdempotencyRecord)]
    before, during = scratch.key("redis-before"), scratch.key("redis-during")
    first = requests.send(before, b"{}", scratch_view(scratch, "redis-before"))
    # The database answers the first retry and copies its response to Redis.
    from_database = requests.send(before, b"{}", scratch_view(scratch, "redis-before"))
    copied = bool(get_redis_connection(alias).exists(redis_copy.redis_key(scratch.scope, before)))
    with CaptureQueriesContext(records) as queries:
        from_redis = requests.send(before, b"{}", scratch_view(scratch, "redis-before"))
    redis_queries = len(queries)

    failures: list[str] = []

    def count_failure(sender: Any, **kwargs: Any) -> None:
        failures.append(str(kwargs.get("operation", "")))

    caches = dict(getattr(settings, "CACHES", {}))
    original = caches[alias]
    caches[_OUTAGE_ALIAS] = {
        key: value
        for key, value in original.items()
        if key in ("KEY_PREFIX", "VERSION", "KEY_FUNCTION")
    } | {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
    }
    outage = {**getattr(settings, "IDEMPOTENCY", {}), "CACHE_ALIAS": _OUTAGE_ALIAS}
    signals.redis_copy_failed.connect(count_failure, dispatch_uid=f"{PREFIX}-{scratch.run}")
    try:
        with override_settings(CACHES=caches, IDEMPOTENCY=outage):
            replay_down = requests.send(before, b"{}", scratch_view(scratch, "redis-before"))
            ran_down = requests.send(during, b"{}", scratch_view(scratch, "redis-during"))
            retry_down = requests.send(during, b"{}", scratch_view(scratch, "redis-during"))
    finally:
        signals.redis_copy_failed.disconnect(dispatch_uid=f"{PREFIX}-{scratch.run}")
    retry_up = requests.send(during, b"{}", scratch_view(scratch, "redis-during"))
    effects = (scratch.effects("redis-before"), scratch.effects("redis-during"))
    evidence = (
        f"with Redis: ran {first.status}, replayed {from_database.status} by the database and "
        f"copied to Redis: {'yes' if copied else 'NO'}, replay "
        f"{from_redis.status} with {redis_queries} database queries; Redis unreachable "
        f"(CACHE_ALIAS pointed at a closed port, in this process only): {len(failures)} Redis "
        f"error(s) absorbed, replay {replay_down.status} "
        f"{'identical' if replay_down.body == first.body else 'DIFFERENT'}, a new key ran "
        f"{ran_down.status} and its retry replayed {retry_down.status}; Redis back: retry "
        f"{retry_up.status} replayed={retry_up.replayed}; effects committed: "
        f"{effects[0]} and {effects[1]}"
    )
    passed = (
        first.ran
        and from_database.replayed
        and copied
        and from_redis.replayed
        and redis_queries == 0
        and bool(failures)
        and replay_down.replayed
        and replay_down.body == first.body
        and ran_down.ran
        and retry_down.replayed
        and retry_up.replayed
        and effects == (1, 1)
    )
    return Result(name, passed, evidence)
