"""The checks that send one key again: concurrent duplicates run once, a different body is
``422``, and a retry is replayed byte for byte without the cookie the first answer set.

They run in this process through the request lifecycle, or against ``--url``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

from django.db import connections

from django_idempotency.operations.verify.client import (
    HOLD_SECONDS,
    Answer,
    Requests,
    scratch_view,
)
from django_idempotency.operations.verify.results import Result, VerifyOptions, error_summary
from django_idempotency.operations.verify.scratch import Scratch

__all__ = ["DuplicateRequests"]


class DuplicateRequests:
    """The checks of a key sent again. The replay check retries the key the concurrency check
    ran, when it ran, so the answer it compares with is one that raced the others."""

    def __init__(self, scratch: Scratch, options: VerifyOptions) -> None:
        self.scratch, self.options = scratch, options
        self.requests = Requests(scratch, options)
        #: The first answers of the concurrency check, which the replay check compares with.
        self.first_answers: dict[str, Answer] = {}

    def concurrent(self) -> Result:
        """``--concurrency`` requests with one key at once: exactly one runs."""
        scratch, options, requests = self.scratch, self.options, self.requests
        name = "concurrent duplicates run once"
        key, count = scratch.key("concurrent"), options.concurrency
        barrier = threading.Barrier(count)
        everyone_answered = threading.Event()
        answers: list[Answer | BaseException] = []
        lock = threading.Lock()

        def one() -> None:
            try:
                barrier.wait(options.timeout)
                answer: Answer | BaseException = requests.send(
                    key,
                    options.url_body,
                    scratch_view(scratch, "concurrent", hold=everyone_answered),
                )
            except Exception as exc:
                answer = exc
            finally:
                connections.close_all()  # this thread's connections only
            with lock:
                answers.append(answer)
                if len(answers) >= count - 1:
                    everyone_answered.set()

        threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(options.timeout + HOLD_SECONDS + 30)
        errors = [answer for answer in answers if isinstance(answer, BaseException)]
        replies = [answer for answer in answers if isinstance(answer, Answer)]
        ran = [answer for answer in replies if answer.ran]
        if ran:
            self.first_answers[key] = ran[0]
        tally = _tally(replies)
        evidence = f"{count} requests with one key at once: {tally}"
        if errors:
            evidence += f"; {len(errors)} raised: {error_summary(errors[0])}"
        effects = None if options.url else scratch.effects("concurrent")
        if effects is not None:
            evidence += f"; effects committed: {effects}"
        accepted = all(
            answer.ran or answer.replayed or answer.status in (409, 503) for answer in replies
        )
        passed = len(ran) == 1 and not errors and accepted and effects in (None, 1)
        return Result(name, passed, evidence)

    def mismatch(self) -> Result:
        """The same key with another body: ``422 payload_mismatch``, and the view ran once."""
        scratch, options, requests = self.scratch, self.options, self.requests
        name = "fingerprint mismatch is 422"
        key = scratch.key("mismatch")
        first = requests.send(key, options.url_body, scratch_view(scratch, "mismatch"))
        other_body = json.dumps({"idempotency_verify": "a different request", "run": scratch.run})
        second = requests.send(key, other_body.encode(), scratch_view(scratch, "mismatch"))
        code = _error_code(second)
        evidence = f"first request {first.status}; same key, different body: {second.status}" + (
            f" {code}" if code else ""
        )
        if not options.url:
            evidence += f"; effects committed: {scratch.effects('mismatch')}"
        once = bool(options.url) or scratch.effects("mismatch") == 1
        return Result(
            name,
            first.ran and second.status == 422 and code == "payload_mismatch" and once,
            evidence,
        )

    def replay(self) -> Result:
        """A retry of a key that ran: replayed, same status and bytes, no ``Set-Cookie``."""
        scratch, options, requests = self.scratch, self.options, self.requests
        name = "replay is byte-identical, no Set-Cookie"
        key = scratch.key("concurrent")
        first = self.first_answers.pop(key, None)
        if first is None:
            key = scratch.key("replay")
            first = requests.send(key, options.url_body, scratch_view(scratch, "replay"))
        retry = requests.send(key, options.url_body, scratch_view(scratch, "replay"))
        same_body = retry.body == first.body
        cookie = retry.headers.get("set-cookie")
        evidence = (
            f"first {first.status} ({len(first.body)} bytes"
            + (", set a cookie" if first.headers.get("set-cookie") else "")
            + f"), retry {retry.status} replayed={retry.replayed}: body "
            + ("identical" if same_body else "DIFFERENT")
            + (f"; Set-Cookie on the replay: {cookie[:80]}" if cookie else ", no Set-Cookie")
        )
        passed = retry.replayed and retry.status == first.status and same_body and not cookie
        return Result(name, passed, evidence)


def _tally(answers: Sequence[Answer]) -> str:
    counts: dict[str, int] = {}
    for answer in answers:
        if answer.ran:
            label = f"ran ({answer.status})"
        elif answer.replayed:
            label = f"replayed ({answer.status})"
        else:
            label = f"answered {answer.status}"
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{number} {label}" for label, number in sorted(counts.items()))


def _error_code(answer: Answer) -> str | None:
    try:
        body = json.loads(answer.body)
    except ValueError:
        return None
    return str(body.get("error")) if isinstance(body, dict) and body.get("error") else None
