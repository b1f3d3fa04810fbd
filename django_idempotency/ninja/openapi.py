"""The key header and the idempotency answers in Ninja's generated OpenAPI schema.

Added to each guarded operation's ``openapi_extra``, which Ninja merges into the operation it
generates: what the operation documents itself (a parameter, a response's content) is kept.
"""

from __future__ import annotations

from typing import Any

from ninja.operation import Operation

from django_idempotency.conf import conf
from django_idempotency.request import lifecycle
from django_idempotency.request.openapi import (
    STATE_ERRORS,
    key_parameter,
    problem_schema,
    replay_header,
    retry_after_header,
)
from django_idempotency.request.responses import PROBLEM_CONTENT_TYPE

__all__ = ["document", "idempotency_openapi"]

#: What Ninja itself answers 422 with, beside ``payload_mismatch``.
_NINJA_422 = (
    " Ninja answers 422 in application/json too, for a request that failed validation (no key "
    "was claimed for it)."
)


def idempotency_openapi(operation: Operation) -> dict[str, Any]:
    """The ``openapi_extra`` of a guarded operation: the key header, ``Idempotent-Replay`` on
    its success responses, and the problem+json answers 400, 409, 422 and 503."""
    problem = {PROBLEM_CONTENT_TYPE: {"schema": problem_schema()}}
    responses: dict[Any, Any] = {}
    for status in operation.response_models:
        if isinstance(status, int) and 200 <= status < 300:
            responses[status] = {"headers": {conf.REPLAY_HEADER: replay_header()}}
    for status, (_, description, retry_after) in STATE_ERRORS.items():
        answer: dict[str, Any] = {
            "description": description + (_NINJA_422 if status == 422 else ""),
            "content": problem,
        }
        if retry_after:
            answer["headers"] = {"Retry-After": retry_after_header()}
        responses[status] = answer
    return {"parameters": [key_parameter()], "responses": responses}


def document(options: lifecycle.Options, operation: Operation) -> None:
    """Add :func:`idempotency_openapi` to ``operation`` when it guards one of its methods."""
    if not set(operation.methods) & set(options.methods):
        return
    extra = idempotency_openapi(operation)
    mine = dict(operation.openapi_extra or {})
    parameters = mine.get("parameters", [])
    header = conf.HEADER.lower()
    if not any(
        p.get("in") == "header" and str(p.get("name", "")).lower() == header for p in parameters
    ):
        mine["parameters"] = [*parameters, *extra["parameters"]]
    responses = dict(mine.get("responses", {}))
    for status, answer in extra["responses"].items():
        responses[status] = {**answer, **responses.get(status, {})}
    mine["responses"] = responses
    operation.openapi_extra = mine
