"""Scratch requests, sent through the request lifecycle in this process or to a deployment's
``--url``, and the answers as the checks read them.

A scratch view writes one effect row in its transaction and sets a cookie: counting the rows
says how often a view really ran, and a replay must never carry the cookie.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.test import RequestFactory

from django_idempotency.conf import conf
from django_idempotency.operations.verify.results import VerifyOptions
from django_idempotency.operations.verify.scratch import PATH, PREFIX, Scratch
from django_idempotency.request.lifecycle import Options, serve

__all__ = ["HOLD_SECONDS", "Answer", "Requests", "answer_of", "scratch_view"]

#: How long the first of the concurrent duplicates holds its lease open for the others.
HOLD_SECONDS = 2.0


@dataclass(slots=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get(conf.REPLAY_HEADER.lower()) == "true"

    @property
    def ran(self) -> bool:
        return self.headers.get(conf.REPLAY_HEADER.lower()) == "false"


def answer_of(response: HttpResponseBase) -> Answer:
    body = response.content if isinstance(response, HttpResponse) else b""
    headers = {name.lower(): value for name, value in response.items()}
    if getattr(response, "cookies", None):
        headers["set-cookie"] = response.cookies.output(header="").strip()
    return Answer(response.status_code, headers, body)


class Requests:
    """Sends scratch requests through the lifecycle (or to ``--url``) and keeps the answers."""

    def __init__(self, scratch: Scratch, options: VerifyOptions) -> None:
        self.scratch = scratch
        self.options = options
        self.factory = RequestFactory()

    def request(self, key: str, body: bytes) -> HttpRequest:
        return self.factory.post(
            PATH, data=body, content_type="application/json", headers={conf.HEADER: key}
        )

    def send(self, key: str, body: bytes, view: Callable[[], HttpResponseBase]) -> Answer:
        if self.options.url:
            return self._http(key, body)
        response = serve(self.request(key, body), view, Options(), scope=lambda: self.scratch.scope)
        return answer_of(response)

    def _http(self, key: str, body: bytes) -> Answer:
        assert self.options.url is not None
        request = urllib.request.Request(
            self.options.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                **self.options.url_headers,
                conf.HEADER: key,
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout) as response:
                return Answer(
                    response.status,
                    {name.lower(): value for name, value in response.headers.items()},
                    response.read(),
                )
        except urllib.error.HTTPError as error:
            return Answer(
                error.code,
                {name.lower(): value for name, value in error.headers.items()},
                error.read(),
            )


def scratch_view(
    scratch: Scratch, name: str, hold: threading.Event | None = None
) -> Callable[[], HttpResponseBase]:
    """A scratch view: one effect row, a cookie that must never be replayed, a JSON body."""

    def view() -> HttpResponseBase:
        scratch.effect(name)
        if hold is not None:
            hold.wait(HOLD_SECONDS)
        response = JsonResponse({"run": scratch.run, "check": name, "at": time.time()}, status=201)
        response.set_cookie(f"{PREFIX}-session", scratch.run)
        return response

    return view
