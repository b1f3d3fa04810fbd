"""The optional Redis copy of completed responses (``IDEMPOTENCY["CACHE_ALIAS"]``).

Redis only ever holds what the database has already committed: a copy of a completed response,
written when the database first replays it (most keys are never retried, and pay no Redis write)
and expiring with the record. A retry with the
same scope (part of the Redis key) and the same fingerprint (stored in the copy) is answered
from it without a query; anything else, including a missing or unreadable copy, asks the
database. So Redis can make an answer cheaper but can never decide one: there is no in-flight
marker in Redis, and a Redis that is down, slow or restarted can never refuse a retry (409) or
replay something the database does not hold.

Each command names one key (``GET``, ``SET``, ``DEL``), under a name hash-tagged per record
(:func:`redis_key`), so the Redis copy works unchanged on Redis Cluster
(:class:`django_idempotency.request.redis_cluster.ClusterConnectionFactory`).

The copy is read only while it pays (:func:`note_claim`): a read that misses costs a round trip
and saves nothing, and on traffic that is mostly first-time keys nearly every read misses. So a
process reads Redis before the database while at least :data:`READ_WHILE_REPLAYS_AT_LEAST` of
its recent claims were replays; below that it goes to the database at once, whose claim decides
anyway, and reads Redis again as soon as retries come back (the database's replays count too).

Any Redis error is logged, sent as :data:`~django_idempotency.signals.redis_copy_failed` and
answered by the database instead. The process then leaves Redis alone for
``CACHE_RETRY_SECONDS``, so a Redis that hangs costs one timeout, not one per request; copies are
still deleted (:func:`forget`) while resting, since a copy left behind could replay a key an
operator released.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import threading
import time
from typing import Any

from django.core.cache import caches
from django.core.signals import setting_changed
from django.dispatch import receiver

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.core.types import Identity, Replay, StoredResponse
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.request import instrumentation

__all__ = [
    "READ_WHILE_REPLAYS_AT_LEAST",
    "REDIS_ERRORS",
    "enabled",
    "forget",
    "hash_tag",
    "lookup",
    "note_claim",
    "redis_key",
    "remember",
]

logger = logging.getLogger(__name__)

try:
    from redis.exceptions import RedisError
except ImportError:  # pragma: no cover - only without the "redis" extra, where the path is off

    class RedisError(Exception):  # type: ignore[no-redef]
        pass


try:
    from redis.exceptions import RedisClusterException
except ImportError:  # pragma: no cover - redis-py before 4.1 has no cluster client

    class RedisClusterException(Exception):  # type: ignore[no-redef]
        pass


#: What counts as "Redis failed": the client's own errors, and the socket errors beneath them.
#: redis-py's cluster client raises ``RedisClusterException`` (not a ``RedisError``) when no node
#: answers or a slot has no master, as happens in the seconds of a failover; and, when threads
#: refresh its table of nodes at once in those seconds, ``RuntimeError`` ("dictionary keys
#: changed during iteration"). Each ``try`` holds one client call and the arguments built for it.
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    RuntimeError,
)

#: ``key_released`` reasons for a request giving up its own PROCESSING record, which never has
#: a copy in Redis; any other release (the admin's, a sweep's) deletes the copy.
_OWN_RELEASE_REASONS = frozenset({"not_stored", "exception", "rolled_back", "refused"})

_COPY = b"C"
#: Reads a copy's metadata line (``json.loads`` without its checks of what it was given).
_JSON = json.JSONDecoder()

#: Per cache alias, when this process may use Redis again after an error (monotonic clock).
_resting_until: dict[str, float] = {}

#: The share of recent claims that must have been replays for a claim to read Redis first. A hit
#: saves a database statement, about twice what a miss costs, so reading pays from about a third
#: of claims on; a quarter leans towards reading.
READ_WHILE_REPLAYS_AT_LEAST = 0.25
#: How many recent claims the share is taken over (the weight of each in a moving average).
_CLAIMS_WEIGHED = 64
#: This process's moving share of claims that ended in a replay; it starts as if all had.
_replay_share = 1.0


def enabled() -> bool:
    return conf.CACHE_ALIAS is not None


def _in_use() -> bool:
    """Enabled, and not resting after a recent error. The database answers meanwhile."""
    alias = conf.CACHE_ALIAS
    return alias is not None and time.monotonic() >= _resting_until.get(alias, 0.0)


def _client() -> Any:
    """The cache's Redis client; for a plain (not cluster) one, this thread's own client on a
    connection it keeps out of the cache's pool.

    Taking a connection from the pool and giving it back, as redis-py does around each command,
    was a third of a ``GET``'s CPU, and every request with the Redis copy on sends one. The kept
    connection is the pool's (its address, timeouts and credentials).
    """
    state = _thread_state()
    if state.client is None:
        shared = _shared_client()
        pool = getattr(shared, "connection_pool", None)
        if pool is None or type(shared) is not _redis_class():
            state.client = shared  # a cluster client, or one of a project's own making
        else:
            state.client = _redis_class()(connection_pool=pool, single_connection_client=True)
    return state.client


class _ThreadState(threading.local):
    """What this thread looked up once and reuses on every command: the cache and its client.

    Asking Django for the cache (a context-local lookup) and django-redis for its client, on
    every command, was 34 of a look-up's 184 Python calls. Looked up again in a forked child,
    and after ``CACHES`` or ``IDEMPOTENCY`` changed (:data:`_generation`).
    """

    pid = -1
    generation = -1
    cache: Any = None
    client: Any = None


_state = _ThreadState()
#: Bumped when ``CACHES`` or ``IDEMPOTENCY`` change: every thread then looks its cache up again.
_generation = 0


def _thread_state() -> _ThreadState:
    state = _state
    if state.generation != _generation or state.pid != os.getpid():
        state.cache = caches[conf.CACHE_ALIAS or "default"]
        state.client = None
        state.pid, state.generation = os.getpid(), _generation
    return state


def _shared_client() -> Any:
    alias = conf.CACHE_ALIAS
    try:
        from django_redis import get_redis_connection

        return get_redis_connection(alias or "default")
    except (ImportError, NotImplementedError) as exc:
        raise IdempotencyConfigurationError(
            f"IDEMPOTENCY['CACHE_ALIAS'] = {alias!r} must name a django-redis cache "
            f"(BACKEND 'django_redis.cache.RedisCache'): {exc}. "
            f"Install django-idempotency[redis], or set CACHE_ALIAS to None."
        ) from exc


@functools.cache
def _redis_class() -> type:
    from redis import Redis

    return Redis


@receiver(setting_changed, dispatch_uid="django_idempotency.request.redis_copy.settings")
def _settings_changed(setting: str, **kwargs: Any) -> None:
    global _generation, _replay_share
    if setting in ("CACHES", "IDEMPOTENCY"):
        _generation += 1
        _replay_share = 1.0


def redis_key(scope: str, key: str) -> str:
    """The copy's name, under the cache's ``KEY_PREFIX`` and ``VERSION``.

    ``idem:{<scope digest>:<record digest>}:<key>``. The braces are a Redis Cluster hash tag:
    every name a record will ever have hashes to one slot, so a script or a transaction over
    them stays legal on a cluster, while records spread over all slots. The tag is made of
    digests so that nothing a client sends can end it early or open another; the record digest
    (128 bits over the scope, its length and the key, so ``("a:b", "c")`` and ``("a", "b:c")``
    differ) tells records apart, the scope digest finds one scope's copies with ``SCAN``, and
    the key at the end finds one key's.
    """
    return str(_thread_state().cache.make_key(f"idem:{{{hash_tag(scope, key)}}}:{key}"))


def hash_tag(scope: str, key: str) -> str:
    """What sits between the braces of every Redis name of the record ``(scope, key)``."""
    scope_digest = hashlib.sha256(scope.encode(errors="surrogatepass")).hexdigest()[:16]
    record = f"{len(scope)}:{scope}:{key}".encode(errors="surrogatepass")
    record_digest = hashlib.sha256(record).hexdigest()[:32]
    return f"{scope_digest}:{record_digest}"


def note_claim(*, replayed: bool) -> None:
    """Count a claim that reached Redis or the database (none kept in memory): whether it ended
    in a replay. Threads may lose an update to each other; the share is a hint, never a
    decision."""
    global _replay_share
    _replay_share += (float(replayed) - _replay_share) / _CLAIMS_WEIGHED


def lookup(identity: Identity) -> Replay | None:
    """The completed response for exactly this request, or None to ask the database (also
    while too few claims are replays for a read to pay: :func:`note_claim`)."""
    if _replay_share < READ_WHILE_REPLAYS_AT_LEAST or not _in_use():
        return None
    try:
        value = _client().get(redis_key(identity.scope, identity.key))
    except REDIS_ERRORS as exc:
        _failed("lookup", identity.scope, identity.key, exc)
        return None
    if value is None:
        return None
    return _decode(bytes(value), identity.fingerprint)


def remember(identity: Identity, stored: StoredResponse, ttl_seconds: float | None) -> None:
    """Copy a committed response, to expire ``ttl_seconds`` from now (the record's TTL; not
    copied when that is unknown)."""
    if ttl_seconds is None:
        return
    milliseconds = int(ttl_seconds * 1000)
    if not _in_use() or milliseconds <= 0:
        return
    try:
        _client().set(
            redis_key(identity.scope, identity.key),
            _encode(identity.fingerprint, stored, time.time() + ttl_seconds),
            px=milliseconds,
        )
    except REDIS_ERRORS as exc:
        _failed("remember", identity.scope, identity.key, exc)


def forget(scope: str, key: str) -> None:
    """Delete the copy: its record is gone. Tried even while resting after an error."""
    if not enabled():
        return
    try:
        _client().delete(redis_key(scope, key))
    except REDIS_ERRORS as exc:
        # The copy may now outlive its record until its own expiry: say so loudly.
        _failed("forget", scope, key, exc, level=logging.ERROR)


@receiver(signals.key_released, dispatch_uid="django_idempotency.request.redis_copy.forget")
def _forget_released(sender: Any, scope: str, key: str, reason: str = "", **kwargs: Any) -> None:
    if reason not in _OWN_RELEASE_REASONS:
        forget(scope, key)


def _encode(fingerprint: str, stored: StoredResponse, expires_at: float) -> bytes:
    """The copy: its metadata as a JSON line, then the body. ``x`` is the record's expiry
    (epoch seconds), for the answers a process keeps in memory (``request/memory.py``)."""
    meta = {
        "f": fingerprint,
        "s": stored.status,
        "h": stored.headers,
        "r": stored.retained,
        # Down to the millisecond, never up: a copy must not outlive its record, by 0.5 ms either.
        "x": math.floor(expires_at * 1000) / 1000,
    }
    return _COPY + json.dumps(meta, separators=(",", ":")).encode() + b"\n" + stored.body


def _decode(value: bytes, fingerprint: str) -> Replay | None:
    """The stored response when the copy is readable and was made for the same fingerprint,
    with the seconds its record has left when the copy says (copies made before it did not)."""
    if not value.startswith(_COPY):
        return None
    head, _, body = value[1:].partition(b"\n")
    try:
        meta = _JSON.decode(head.decode())
        if meta["f"] != fingerprint:
            return None  # the database decides between a replay and 422
        stored = StoredResponse(
            status=int(meta["s"]),
            headers=[(str(name), str(val)) for name, val in meta["h"]],
            body=body,
            retained=bool(meta["r"]),
        )
        expires_at = meta.get("x")
        expires_in = None if expires_at is None else float(expires_at) - time.time()
        return Replay(stored, expires_in=expires_in)
    except (ValueError, KeyError, TypeError):
        logger.warning("unreadable idempotency entry in Redis; asking the database")
        return None


def _failed(
    operation: str, scope: str, key: str, exc: BaseException, level: int = logging.WARNING
) -> None:
    alias, pause = conf.CACHE_ALIAS, conf.CACHE_RETRY_SECONDS
    if alias is not None and pause > 0:
        _resting_until[alias] = time.monotonic() + pause
    instrumentation.redis_copy_failed(operation, scope, key, exc, level)
