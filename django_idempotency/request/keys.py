"""Parsing the Idempotency-Key header.

The IETF draft sends the key as a structured-field string (``"8e03..."``); many clients send a
bare token. Both spellings of the same characters name the same record.
"""

from __future__ import annotations

import hashlib

from django_idempotency.exceptions import IdempotencyKeyInvalid

MAX_KEY_LENGTH = 255

_BARE_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {",", '"', "\\"}
_QUOTED_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F))


def parse_key(raw: str) -> str:
    """Return the key in ``raw`` or raise :class:`IdempotencyKeyInvalid`.

    A header sent twice reaches Django joined by a comma, which no valid key contains outside
    quotes, so it is refused here too.
    """
    value = raw.strip(" \t")
    if value.startswith('"'):
        key = _parse_sf_string(value)
    elif value and all(char in _BARE_CHARS for char in value):
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
    """What logs show of a key: enough to correlate, not enough to replay it."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:12]
