"""Capturing a response for the record, and rebuilding it for a replay."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.http import HttpResponse, HttpResponseBase, JsonResponse

from django_idempotency.conf import conf
from django_idempotency.exceptions import IdempotencyHTTPError

PROBLEM_CONTENT_TYPE = "application/problem+json"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """What a replay needs: status, allowed headers and the exact body bytes."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    retained: bool = True


def capture(response: HttpResponseBase) -> StoredResponse:
    """Copy what may be stored; a streaming or oversized body is recorded as not retained."""
    allowed = conf.STORED_RESPONSE_HEADERS
    headers = [(name, value) for name, value in response.items() if name.lower() in allowed]
    if response.streaming or not isinstance(response, HttpResponse):
        return StoredResponse(response.status_code, headers, b"", retained=False)
    body = response.content
    if len(body) > conf.MAX_RESPONSE_BYTES:
        return StoredResponse(response.status_code, headers, b"", retained=False)
    return StoredResponse(response.status_code, headers, body)


def replay(stored: StoredResponse) -> HttpResponse:
    """The stored response again, marked as a replay."""
    if not stored.retained:
        return _not_retained(stored)
    response = HttpResponse(stored.body, status=stored.status)
    del response["Content-Type"]
    for name, value in stored.headers:
        response[name] = value
    response[conf.REPLAY_HEADER] = "true"
    return response


def _not_retained(stored: StoredResponse) -> HttpResponse:
    """Same status, and a body that says plainly the original one was not kept."""
    body = {
        "type": f"{conf.ERROR_TYPE_BASE}response_not_retained",
        "title": "Response not retained",
        "status": stored.status,
        "detail": (
            "This request was already processed. Its response body was streamed or larger "
            "than MAX_RESPONSE_BYTES, so it was not stored and cannot be replayed."
        ),
        "error": "response_not_retained",
        "message": "The request was already processed; its response body was not retained.",
    }
    response = JsonResponse(body, status=stored.status, content_type=PROBLEM_CONTENT_TYPE)
    for name, value in stored.headers:
        if name.lower() not in ("content-type", "content-length"):
            response[name] = value
    response[conf.REPLAY_HEADER] = "true"
    return response


def problem_response(error: IdempotencyHTTPError) -> HttpResponse:
    """Our own errors for views outside DRF: problem+json with Retry-After where it applies."""
    response = JsonResponse(
        error.problem(conf.ERROR_TYPE_BASE),
        status=error.status_code,
        content_type=PROBLEM_CONTENT_TYPE,
    )
    if error.wait:
        response["Retry-After"] = str(error.wait)
    return response


def headers_as_json(headers: list[tuple[str, str]]) -> list[list[str]]:
    return [[name, value] for name, value in headers]


def headers_from_json(value: Any) -> list[tuple[str, str]]:
    return [(str(name), str(val)) for name, val in value or ()]
