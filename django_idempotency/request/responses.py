"""Responses: capturing one for the record, rebuilding it for a replay, and our errors as
``application/problem+json`` (RFC 9457), built in one place."""

from __future__ import annotations

from collections.abc import Mapping

from django.http import HttpResponse, HttpResponseBase, JsonResponse

from django_idempotency.conf import conf
from django_idempotency.core.types import StoredResponse
from django_idempotency.exceptions import IdempotencyHTTPError, ResponseNotRetained

__all__ = ["PROBLEM_CONTENT_TYPE", "capture", "problem_response", "replay"]

PROBLEM_CONTENT_TYPE = "application/problem+json"


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


def replay(stored: StoredResponse, headers: Mapping[str, str] | None = None) -> HttpResponse:
    """The stored response again, marked as a replay; ``headers`` are set over the stored ones
    (a framework's own, which it adds to every answer: DRF's ``Allow``)."""
    if not stored.retained:
        return _not_retained(stored, headers)
    # A dict: Django unpacks it without checking each pair's length (a replay's hot path).
    sent = dict(stored.headers)
    sent[conf.REPLAY_HEADER] = "true"
    if headers:
        sent.update(headers)
    response = HttpResponse(stored.body, status=stored.status, headers=sent)
    if "Content-Type" not in sent and not any(
        name.lower() == "content-type" for name, _ in stored.headers
    ):
        del response["Content-Type"]  # Django's default, which the first answer did not send
    return response


def _not_retained(stored: StoredResponse, headers: Mapping[str, str] | None) -> HttpResponse:
    """Same status, and a body that says plainly the original one was not kept."""
    response = problem_response(ResponseNotRetained(stored.status))
    for name, value in stored.headers:
        if name.lower() not in ("content-type", "content-length"):
            response[name] = value
    response[conf.REPLAY_HEADER] = "true"
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def problem_response(error: IdempotencyHTTPError) -> HttpResponse:
    """Our errors as problem+json, with Retry-After where it applies (DRF views get the same
    body through DRF's exception handling, see ``drf.problem_details``)."""
    response = JsonResponse(
        error.problem(conf.ERROR_TYPE_BASE),
        status=error.status_code,
        content_type=PROBLEM_CONTENT_TYPE,
    )
    if error.wait:
        response["Retry-After"] = str(error.wait)
    return response
