"""Answers this process gave lately, kept in memory for a retry storm (``LOCAL_REPLAY_SECONDS``).

A client that retries a completed request many times in a few seconds, or a webhook sender that
redelivers in bursts, is answered here, without a round trip to Redis or the database. Off by
default (``LOCAL_REPLAY_SECONDS = 0``). What turning it on gives up, and what it keeps:

* An entry lives at most ``LOCAL_REPLAY_SECONDS`` after this process stored or read the
  response, and never past its record's expiry as this process learnt it (from the database's
  clock, or from the expiry the Redis copy carries); a copy that carries none is not kept.
* A key released in this process (an operator's release) is forgotten here at once
  (``key_released``); released in another process, it is replayed here for up to
  ``LOCAL_REPLAY_SECONDS`` more.
* Entries are per scope and key, and a request with another fingerprint is never answered from
  here (the database decides between its replay and a 422), so a replay never crosses callers.
* Only the final response of a completed key is kept; a handed-off request's 202 is not.
* At most ``LOCAL_REPLAY_ENTRIES`` entries, the least recently used dropped first.

Whatever the setting, the keys answered lately are noted (a hash each, :func:`answered`): their
next request is likely a retry, which the record store then reads before claiming it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.core.bounded import Recently
from django_idempotency.core.types import Identity, StoredResponse

__all__ = ["answered", "clear", "forget", "lookup", "remember"]

#: How many keys :func:`answered` knows (a hash each); when full it starts again empty.
ANSWERED_ENTRIES = 8192

#: (scope, key) -> (monotonic deadline, fingerprint, response), least recently used first.
_entries: OrderedDict[tuple[str, str], tuple[float, str, StoredResponse]] = OrderedDict()
_lock = threading.Lock()
#: Hashes of (scope, key) this process completed or replayed lately (see :func:`answered`).
_answered: Recently[int, bool] = Recently(entries=ANSWERED_ENTRIES)


def answered(identity: Identity) -> bool:
    """Whether this process completed or replayed this key lately, whatever
    ``LOCAL_REPLAY_SECONDS`` says: its next request is then likely a retry, which is then
    answered from a read where it can be (``claims.answer``) before any claim. A hint, never
    an answer: wrong either way (a hash collision, a key released or expired since), it costs
    one read or one claim statement, and the decision is still the database's."""
    return hash((identity.scope, identity.key)) in _answered


def lookup(identity: Identity) -> StoredResponse | None:
    """The response kept for exactly this request, or None to ask Redis or the database."""
    if conf.LOCAL_REPLAY_SECONDS <= 0:
        return None
    name = (identity.scope, identity.key)
    with _lock:
        entry = _entries.get(name)
        if entry is None:
            return None
        deadline, fingerprint, stored = entry
        if deadline <= time.monotonic():
            del _entries[name]
            return None
        if fingerprint != identity.fingerprint:
            return None
        _entries.move_to_end(name)
        return stored


def remember(identity: Identity, stored: StoredResponse, expires_in: float | None) -> None:
    """Keep a completed key's response for ``LOCAL_REPLAY_SECONDS``, or until its record's
    expiry ``expires_in`` seconds from now if sooner; not at all when that is unknown. The key
    is noted as :func:`answered` in any case."""
    _answered.put(hash((identity.scope, identity.key)), True)
    keep = conf.LOCAL_REPLAY_SECONDS
    if keep <= 0 or expires_in is None:
        return
    seconds = min(keep, expires_in)
    if seconds <= 0:
        return
    capacity = conf.LOCAL_REPLAY_ENTRIES
    name = (identity.scope, identity.key)
    with _lock:
        _entries[name] = (time.monotonic() + seconds, identity.fingerprint, stored)
        _entries.move_to_end(name)
        while len(_entries) > capacity:
            _entries.popitem(last=False)


def forget(scope: str, key: str) -> None:
    with _lock:
        _entries.pop((scope, key), None)


def clear() -> None:
    with _lock:
        _entries.clear()
    _answered.clear()


@receiver(signals.key_released, dispatch_uid="django_idempotency.request.memory.forget")
def _forget_released(sender: Any, scope: str, key: str, **kwargs: Any) -> None:
    forget(scope, key)


@receiver(setting_changed, dispatch_uid="django_idempotency.request.memory.settings")
def _settings_changed(setting: str, **kwargs: Any) -> None:
    # A test (or a deploy that reloads settings) starts from what the new settings say.
    if setting == "IDEMPOTENCY":
        clear()
