"""The idempotency answers as OpenAPI describes them, for any framework's schema: the key header,
the problem+json body, ``Retry-After`` and ``Idempotent-Replay``. Framework-free: the DRF door
(``drf/openapi.py``, drf-spectacular) and the Ninja door (``ninja/``) both build on it.
"""

from __future__ import annotations

from typing import Any

from django_idempotency.conf import conf

__all__ = [
    "KEY_PATTERN",
    "PROBLEM_COMPONENT",
    "STATE_ERRORS",
    "key_parameter",
    "problem_schema",
    "replay_header",
    "retry_after_header",
]

PROBLEM_COMPONENT = "IdempotencyProblem"

#: status -> (error codes the body may carry, what it means for the client, Retry-After sent)
STATE_ERRORS: dict[int, tuple[tuple[str, ...], str, bool]] = {
    400: (
        ("idempotency_key_missing", "idempotency_key_invalid"),
        "The idempotency key is missing or malformed. Nothing was done and nothing was stored: "
        "fix the request and send it again, with the same key.",
        False,
    ),
    409: (
        ("transaction_in_progress", "idempotency_lease_lost"),
        "A request with this key is still in progress. Nothing was done: retry with the same "
        "key after Retry-After seconds.",
        True,
    ),
    422: (
        ("payload_mismatch",),
        "The key was already used for a different request (method, path or body). Nothing was "
        "done: use a new key for a new request.",
        False,
    ),
    503: (
        ("idempotency_store_unavailable",),
        "The database that records keys is unavailable. Nothing was done: retry with the same "
        "key after Retry-After seconds.",
        True,
    ),
}


def problem_schema() -> dict[str, Any]:
    """RFC 9457 problem details plus the short ``error`` code and ``message`` (what to do)."""
    codes = ", ".join(sorted(code for codes, _, _ in STATE_ERRORS.values() for code in codes))
    return {
        "type": "object",
        "properties": {
            "type": {"type": "string", "format": "uri-reference"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            # Not an enum: drf-spectacular would lift it into a component named after the
            # property ("ErrorEnum"), which collides with the project's own "error" fields.
            "error": {"type": "string", "description": f"One of: {codes}."},
            "message": {
                "type": "string",
                "description": "What the client should do, in a few words; detail explains.",
            },
        },
        "required": ["type", "title", "status", "detail", "error", "message"],
    }


#: What parse_key accepts, for clients and schema-driven test tools: a bare token (printable
#: ASCII but for spaces, commas, double quotes and backslashes), or a quoted string with no space
#: at either end (RFC 8941 escapes, which it also accepts, are left out of the pattern).
KEY_PATTERN = r'^(?:[!#-+\--\[\]-~]{1,255}|"[!#-\[\]-~](?:[ !#-\[\]-~]{0,253}[!#-\[\]-~])?")$'


def key_parameter(*, required: bool | None = None) -> dict[str, Any]:
    """The ``Idempotency-Key`` request header (``HEADER``); required as ``KEY_REQUIRED`` says
    unless ``required`` is given."""
    return {
        "in": "header",
        "name": conf.HEADER,
        "required": conf.KEY_REQUIRED if required is None else required,
        "schema": {"type": "string", "minLength": 1, "maxLength": 257, "pattern": KEY_PATTERN},
        "description": (
            "A unique key per operation (a UUID works well): 1 to 255 characters, either a bare "
            "token of printable ASCII without spaces, commas, double quotes or backslashes, or a "
            "double-quoted string of printable ASCII. Retrying with the same key and the same "
            "request returns the first response instead of doing the work again."
        ),
    }


def replay_header() -> dict[str, Any]:
    return {
        "schema": {"type": "string", "enum": ["true", "false"]},
        "description": "true when this response is a stored one, replayed for a retry.",
    }


def retry_after_header() -> dict[str, Any]:
    return {
        "schema": {"type": "integer", "minimum": 1},
        "description": "Seconds to wait before retrying with the same key.",
    }
