"""The check that a request killed mid-view is taken over and runs once.

A child process claims a key with a short lease, writes its effect inside the view and is killed
with ``SIGKILL``; retries get ``409`` while the lease runs, then one takes the key over and runs,
and the killed request's write never committed.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.db import router
from django.http import HttpResponseBase
from django.test import RequestFactory

from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord
from django_idempotency.operations.verify.client import Answer, Requests, scratch_view
from django_idempotency.operations.verify.harness import (
    ChildUnavailable,
    await_line,
    kill,
    spawned,
)
from django_idempotency.operations.verify.results import Result, VerifyOptions
from django_idempotency.operations.verify.scratch import PATH, Scratch
from django_idempotency.request.lifecycle import Options, serve

__all__ = ["child", "killed_request"]


def killed_request(scratch: Scratch, options: VerifyOptions) -> Result:
    """A child claims a key and is killed mid-view; a retry must take it over and run once."""
    name = "killed request taken over, runs once"
    key = scratch.key("killed")
    arguments = {
        "scope": scratch.scope,
        "key": key,
        "body": options.url_body.decode(),
        "lease": options.lease_seconds,
    }
    try:
        with spawned(__name__, arguments) as child_process:
            await_line(child_process, "IN-VIEW", options.timeout)
            kill(child_process)
            pid = child_process.pid
    except ChildUnavailable as problem:
        return Result(name, None, f"not run: {problem}")
    requests = Requests(scratch, VerifyOptions(url_body=options.url_body))
    view = scratch_view(scratch, "killed")
    answers: list[Answer] = []
    deadline = time.monotonic() + options.lease_seconds + options.timeout
    while time.monotonic() < deadline:
        answer = requests.send(key, options.url_body, view)
        answers.append(answer)
        if answer.status != 409:
            break
        time.sleep(0.2)
    conflicts = [answer for answer in answers if answer.status == 409]
    final = answers[-1]
    record = IdempotencyRecord.objects.using(router.db_for_write(IdempotencyRecord)).filter(
        scope=scratch.scope, key=key
    )
    attempts = record.values_list("attempts", flat=True).first()
    effects = scratch.effects("killed")
    evidence = (
        f"child pid {pid} claimed the key (lease {options.lease_seconds:g} s), wrote its effect "
        f"and was killed (SIGKILL) mid-view; "
        + (
            f"{len(conflicts)} retries during the lease answered 409 (Retry-After "
            f"{conflicts[0].headers.get('retry-after', '?')}); "
            if conflicts
            else "the first retry took the key over at once (its owner's connection was gone); "
        )
        + f"then {final.status}, {'ran' if final.ran else 'did not run'} as attempt {attempts}; "
        f"effects committed: {effects}"
    )
    passed = final.ran and final.status == 201 and attempts == 2 and effects == 1
    return Result(name, passed, evidence)


def child(arguments: dict[str, Any]) -> None:
    """The killed request, in its child process: claims the key, writes its effect, says
    ``IN-VIEW`` and waits to be killed inside the view's transaction."""
    # This process's own settings: a short lease, and no heartbeat to keep it alive.
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "LEASE_SECONDS": arguments["lease"],
        "LEASE_HEARTBEAT": False,
    }
    scratch = Scratch()
    scratch.scope = arguments["scope"]

    def view() -> HttpResponseBase:
        scratch.effect("killed")
        print("IN-VIEW", flush=True)
        time.sleep(3600)  # killed here, inside the view's transaction
        raise AssertionError("not killed")

    request = RequestFactory().post(
        PATH,
        data=arguments["body"].encode(),
        content_type="application/json",
        headers={conf.HEADER: arguments["key"]},
    )
    serve(request, view, Options(), scope=lambda: scratch.scope)
