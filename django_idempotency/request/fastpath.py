"""The optional Redis fast path in front of the database claim (``IDEMPOTENCY["CACHE_ALIAS"]``).

One Redis entry per ``(scope, key)``, holding either an in-flight marker (owner token and
fingerprint, expiring with the lease) or a copy of the completed response (expiring with the
record). The database stays the source of truth; Redis may only make an answer cheaper:

* A replay is served from Redis only when the entry was written by the request that completed
  the record, after its transaction committed, and only to a request with the same scope (part
  of the Redis key) and the same fingerprint (stored in the entry). Anything else, including a
  missing or unreadable entry, falls through to the database.
* A concurrent duplicate is answered 409 from the marker, which is set before the database claim
  and expires no later than the database lease, so a request that died never blocks longer than
  the database would.
* Every write that replaces or removes a marker compares the owner token first (Lua scripts), so
  a request can only ever touch its own marker.
* Any Redis error is logged, sent as :data:`~django_idempotency.signals.fast_path_failed` and
  answered by the database path instead. The process then leaves Redis alone for
  ``CACHE_RETRY_SECONDS``, so a Redis that hangs costs one timeout, not one per request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import uuid
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any

from django.core.cache import caches
from django.dispatch import receiver
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request.keys import redact
from django_idempotency.request.responses import StoredResponse

if TYPE_CHECKING:
    from django_idempotency.request.engine import Decision, Identity, Lease

logger = logging.getLogger(__name__)

try:
    from redis.exceptions import NoScriptError, RedisError
except ImportError:  # pragma: no cover - only without the "redis" extra, where the path is off

    class RedisError(Exception):  # type: ignore[no-redef]
        pass

    class NoScriptError(RedisError):  # type: ignore[no-redef]
        pass


#: What counts as "Redis failed": the client's own errors, and the socket errors beneath them.
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError)

#: ``key_released`` reasons sent by :func:`engine.release`, which has already removed its own
#: marker by owner token; any other reason (the admin's, a sweep's) deletes the entry outright.
_OWNED_RELEASE_REASONS = frozenset({"not_stored", "exception"})

_MARKER = b"P"
_COMPLETED = b"C"

# Returns the current entry and its remaining milliseconds, or sets our marker and returns nil:
# one round trip answers "replay", "in flight" or "yours".
_CLAIM_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current then
    return {current, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""

# Replaces our marker with the completed response. A missing marker means it expired or the key
# was released (for instance by the admin) since: then nothing is written, and replays keep
# coming from the database, which knows.
_COMPLETE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
end
return 0
"""

_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


#: Per cache alias, when this process may use Redis again after an error (monotonic clock).
_resting_until: dict[str, float] = {}


def enabled() -> bool:
    return conf.CACHE_ALIAS is not None


def _in_use() -> bool:
    """Enabled, and not resting after a recent error. The database answers meanwhile."""
    alias = conf.CACHE_ALIAS
    return alias is not None and time.monotonic() >= _resting_until.get(alias, 0.0)


def _rest() -> None:
    alias, pause = conf.CACHE_ALIAS, conf.CACHE_RETRY_SECONDS
    if alias is not None and pause > 0:
        _resting_until[alias] = time.monotonic() + pause


def _client() -> Any:
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


def redis_key(scope: str, key: str) -> str:
    """The entry's name. The scope's length keeps ``("a:b", "c")`` apart from ``("a", "b:c")``."""
    cache = caches[conf.CACHE_ALIAS or "default"]
    return str(cache.make_key(f"idem:{len(scope)}:{scope}:{key}"))


def _marker(owner_token: uuid.UUID, fingerprint: str) -> bytes:
    return _MARKER + owner_token.hex.encode() + fingerprint.encode()


def _completed(fingerprint: str, stored: StoredResponse) -> bytes:
    meta = {"f": fingerprint, "s": stored.status, "h": stored.headers, "r": stored.retained}
    return _COMPLETED + json.dumps(meta, separators=(",", ":")).encode() + b"\n" + stored.body


def _script(source: str, scope: str, key: str, *args: Any) -> Any:
    """Run a script on the entry; EVALSHA, sending the source when Redis does not know it."""
    client = _client()
    name = redis_key(scope, key)
    try:
        return client.evalsha(_sha1(source), 1, name, *args)
    except NoScriptError:
        return client.eval(source, 1, name, *args)


@cache
def _sha1(source: str) -> str:
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


# --- the hooks engine.py calls -----------------------------------------------------------------


def claim(identity: Identity, owner_token: uuid.UUID) -> tuple[Decision | None, bool]:
    """Answer from Redis if it safely can; else try to mark the key in flight for this request.

    Returns ``(decision, marked)``: a decision (replay or 409) ends the claim without a query;
    ``marked`` says our marker is now set, and must be released unless the database claim
    lets this request run.
    """
    if not _in_use():
        return None, False
    lease_ms = max(1, int(conf.LEASE_SECONDS * 1000))
    try:
        found = _script(
            _CLAIM_SCRIPT,
            identity.scope,
            identity.key,
            _marker(owner_token, identity.fingerprint),
            lease_ms,
        )
    except REDIS_ERRORS as exc:
        _failed("claim", identity.scope, identity.key, exc)
        return None, False
    if found is None:
        return None, True
    value, remaining_ms = found
    return _decide(bytes(value), int(remaining_ms), identity), False


def _decide(value: bytes, remaining_ms: int, identity: Identity) -> Decision | None:
    """A decision from an entry that matches this request exactly; ``None`` asks the database."""
    from django_idempotency.request.engine import Conflict, Replay

    fingerprint = identity.fingerprint.encode()
    if value.startswith(_MARKER):
        if value[33:] != fingerprint:
            return None  # the database decides between 409 and 422
        return Conflict(retry_after=max(1, math.ceil(remaining_ms / 1000)))
    if not value.startswith(_COMPLETED):
        return None
    head, _, body = value[1:].partition(b"\n")
    try:
        meta = json.loads(head)
        if meta["f"] != identity.fingerprint:
            return None
        stored = StoredResponse(
            status=int(meta["s"]),
            headers=[(str(name), str(val)) for name, val in meta["h"]],
            body=body,
            retained=bool(meta["r"]),
        )
    except (ValueError, KeyError, TypeError):
        logger.warning("unreadable idempotency entry in Redis; asking the database")
        return None
    return Replay(stored)


def completed(lease: Lease, stored: StoredResponse, expires_at: datetime) -> None:
    """After commit: swap our marker for the response, to expire with the database record."""
    if not _in_use():
        return
    identity = lease.identity
    remaining_ms = int((expires_at - timezone.now()).total_seconds() * 1000)
    if remaining_ms <= 0:
        return
    try:
        _script(
            _COMPLETE_SCRIPT,
            identity.scope,
            identity.key,
            _marker(lease.owner_token, identity.fingerprint),
            _completed(identity.fingerprint, stored),
            remaining_ms,
        )
    except REDIS_ERRORS as exc:
        _failed("complete", identity.scope, identity.key, exc)


def release(identity: Identity, owner_token: uuid.UUID) -> None:
    """Delete our marker, compared by owner token, so a retry need not wait for it to expire."""
    if not _in_use():
        return
    try:
        _script(
            _RELEASE_SCRIPT,
            identity.scope,
            identity.key,
            _marker(owner_token, identity.fingerprint),
        )
    except REDIS_ERRORS as exc:
        _failed("release", identity.scope, identity.key, exc)


def forget(scope: str, key: str) -> None:
    """Delete the entry whoever wrote it: its database record is gone.

    Tried even while resting after an error: a copy left behind could replay a released key.
    """
    if not enabled():
        return
    try:
        _client().delete(redis_key(scope, key))
    except REDIS_ERRORS as exc:
        # The copy may now outlive its record until its own expiry: say so loudly.
        _failed("forget", scope, key, exc, level=logging.ERROR)


@receiver(signals.key_released, dispatch_uid="django_idempotency.request.fastpath.forget")
def _forget_released(sender: Any, scope: str, key: str, reason: str = "", **kwargs: Any) -> None:
    if reason not in _OWNED_RELEASE_REASONS:
        forget(scope, key)


def _failed(
    operation: str, scope: str, key: str, exc: BaseException, level: int = logging.WARNING
) -> None:
    _rest()
    logger.log(
        level,
        "idempotency Redis fast path failed; using the database",
        extra={
            "idempotency_event": "fast_path_failed",
            "idempotency_operation": operation,
            "idempotency_scope": scope,
            "idempotency_key": key if conf.LOG_KEYS else redact(key),
        },
        exc_info=exc,
    )
    signals.fast_path_failed.send(
        sender=IdempotencyRecord, scope=scope, key=key, operation=operation, error=exc
    )
