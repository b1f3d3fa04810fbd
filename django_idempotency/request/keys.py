"""Parsing the Idempotency-Key header.

The IETF draft sends the key as a structured-field string (``"8e03..."``); many clients send a
bare token. Both spellings of the same characters name the same record.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from typing import Any

from django.conf import settings
from django.http.request import HttpHeaders
from django.utils.encoding import force_bytes

from django_idempotency.core.types import MAX_KEY_LENGTH
from django_idempotency.exceptions import IdempotencyKeyInvalid

__all__ = ["MAX_KEY_LENGTH", "header", "parse_key", "redact", "salted_digest"]


_BARE_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {",", '"', "\\"}
_QUOTED_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F))
#: Keeps :func:`redact`'s HMAC apart from every other use of SECRET_KEY.
_REDACT_SALT = "django_idempotency.request.keys.redact"


def header(request: Any, name: str) -> str | None:
    """One request header, read from ``META`` (WSGI and ASGI alike): ``request.headers`` would
    build a dict of every header the request sent, on every request, to read one."""
    value: str | None = request.META.get(_meta_name(name))
    return value


@functools.lru_cache(maxsize=64)
def _meta_name(name: str) -> str:
    """``HTTP_IDEMPOTENCY_KEY`` for ``Idempotency-Key``: the few names read, worked out once."""
    return HttpHeaders.to_wsgi_name(name)


def parse_key(raw: str) -> str:
    """Return the key in ``raw`` or raise :class:`IdempotencyKeyInvalid`.

    A header sent twice reaches Django joined by a comma, which no valid key contains outside
    quotes, so it is refused here too.
    """
    value = raw.strip(" \t")
    if value.startswith('"'):
        key = _parse_sf_string(value)
    elif value and _BARE_CHARS.issuperset(value):
        key = value
    else:
        raise IdempotencyKeyInvalid()
    if not 1 <= len(key) <= MAX_KEY_LENGTH or key != key.strip(" "):
        raise IdempotencyKeyInvalid()
    return key


def _parse_sf_string(value: str) -> str:
    """RFC 8941 sf-string: the whole value must be one quoted string, nothing after it."""
    chars: list[str] = []
    index = 1
    while index < len(value):
        char = value[index]
        if char == "\\":
            index += 1
            if index == len(value) or value[index] not in '"\\':
                raise IdempotencyKeyInvalid()
            chars.append(value[index])
        elif char == '"':
            if index != len(value) - 1:
                raise IdempotencyKeyInvalid()
            return "".join(chars)
        elif char in _QUOTED_CHARS:
            chars.append(char)
        else:
            raise IdempotencyKeyInvalid()
        index += 1
    raise IdempotencyKeyInvalid()


def redact(key: str) -> str:
    """What logs show of a key: enough to correlate, not enough to replay it.

    A keyed hash (HMAC-SHA256 under a key derived from SECRET_KEY), because keys are often
    guessable (``order-123``) and a plain hash of a guess would find them. Rotating
    SECRET_KEY changes every redacted form.
    """
    return "hmac:" + salted_digest(_REDACT_SALT, key)[:12]


def salted_digest(salt: str, value: str) -> str:
    """Django's ``salted_hmac(salt, value, algorithm="sha256").hexdigest()``, its key derived
    once per ``SECRET_KEY`` rather than on every call: the credentials' scope is one per
    request."""
    key = _salted_key(salt, settings.SECRET_KEY)
    return hmac.digest(key, value.encode(), "sha256").hex()


@functools.lru_cache(maxsize=16)
def _salted_key(salt: str, secret: str | bytes) -> bytes:
    return hashlib.sha256(force_bytes(salt) + force_bytes(secret)).digest()
