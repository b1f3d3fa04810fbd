"""202 Accepted for long operations: a view hands its work to a worker under the request's key.

The view validates the request, then calls :func:`hand_off` with a topic (a Celery task's name,
routed by ``OUTBOX_PUBLISHERS``) and the work's keyword arguments, and returns the 202 it gets
back. The work goes out through the outbox, in the view's own transaction, so it is enqueued
exactly when the request's writes commit; the lifecycle stores the 202 and hands the key to the
worker in that same transaction (``request/lifecycle.py``). The worker's task, decorated with
:func:`handed_off`, runs the work once and stores its final response under the same key and
owner token: from then on retries of the request, and the key's status URL, return it.

::

    @api_view(["POST"])
    @idempotent(long_running=True)
    def create_payout(request):
        serializer = PayoutSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        return hand_off(request, "payouts.send", **serializer.validated_data)

    @shared_task(acks_late=True, reject_on_worker_lost=True)
    @handed_off
    def send_payout(**payout):
        ...  # the effect, in the transaction that stores the final response
        return JsonResponse(result, status=201)
"""

from __future__ import annotations

import enum
import functools
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, ParamSpec

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.urls import NoReverseMatch, reverse

from django_idempotency.conf import conf
from django_idempotency.core.types import Identity, Lease
from django_idempotency.exceptions import IdempotencyKeyMissing
from django_idempotency.outbox.publish import publish
from django_idempotency.request.lifecycle import rendered
from django_idempotency.request.responses import capture
from django_idempotency.request.run_step import HANDED_OFF, Ended, HandOff, Keep, run_step

__all__ = [
    "HAND_OFF_ARGUMENT",
    "HandOffOutcome",
    "ahand_off",
    "hand_off",
    "handed_off",
    "lease_of",
]

#: The keyword argument that carries the key and its owner token to the worker's task;
#: :func:`handed_off` takes it off before the task's own function runs.
HAND_OFF_ARGUMENT = "idempotency_hand_off"
#: The URL name of the key's status view (``include("django_idempotency.urls")``).
STATUS_URL_NAME = "idempotency-key-status"

P = ParamSpec("P")


class HandOffOutcome(enum.Enum):
    """What became of one delivery of a handed-off request's work."""

    #: The work ran and its final response is stored.
    COMPLETED = "completed"
    #: An earlier delivery completed it: nothing ran (a redelivery, a relay sending twice).
    ALREADY_COMPLETED = "already_completed"
    #: The key is no longer this hand-off's (its hold ran out and a retry took it over, or an
    #: operator released it): nothing ran; the new owner does the work.
    NOT_OURS = "not_ours"
    #: The work marked its transaction for rollback (``set_rollback``, a database error it
    #: caught): nothing of it committed, and the key is released, as a view's would be, so
    #: the client's retry of the request hands the work off anew.
    RELEASED = "released"


_OUTCOMES = {
    Ended.COMPLETED: HandOffOutcome.COMPLETED,
    Ended.ALREADY_COMPLETED: HandOffOutcome.ALREADY_COMPLETED,
    Ended.NOT_OURS: HandOffOutcome.NOT_OURS,
    Ended.ROLLED_BACK: HandOffOutcome.RELEASED,
}


def hand_off(
    request: HttpRequest | Any,
    topic: str,
    /,
    *,
    hold_seconds: float | None = None,
    status_url: str | None = None,
    **work: Any,
) -> JsonResponse:
    """Enqueue ``work`` for a worker under this request's key, and return the 202 to answer.

    Call it inside a guarded view (``@idempotent``, ``IdempotencyMixin`` or the middleware),
    which must return the response it gets; ``request`` is the view's (Django's or DRF's).
    ``topic`` routes the work (``OUTBOX_PUBLISHERS``; with ``CeleryPublisher`` it is the task's
    name by default) and ``work`` becomes the task's keyword arguments, JSON as for any outbox
    payload. The worker holds the key for ``hold_seconds`` (``HANDOFF_HOLD_SECONDS`` by
    default). The 202's ``Location`` is the key's status URL (the ``idempotency-key-status``
    route, or ``status_url``).

    Raises :class:`IdempotencyKeyMissing` (400) when the request carries no key: without one
    there is nothing to fence the worker with.
    """
    lease = getattr(request, "idempotency", None)
    if not isinstance(lease, Lease):
        raise IdempotencyKeyMissing(
            f"This operation runs in the background and requires an {conf.HEADER} header."
        )
    hold = conf.HANDOFF_HOLD_SECONDS if hold_seconds is None else float(hold_seconds)
    location = status_url if status_url is not None else _status_url(lease.identity.key)
    publish(topic, {**work, HAND_OFF_ARGUMENT: _ticket(lease, hold)}, using=lease.using)
    response = JsonResponse(
        {"key": lease.identity.key, "status": "processing", "status_url": location},
        status=202,
    )
    response["Location"] = location
    setattr(response, HANDED_OFF, HandOff(hold_seconds=hold))
    return response


async def ahand_off(
    request: HttpRequest | Any,
    topic: str,
    /,
    *,
    hold_seconds: float | None = None,
    status_url: str | None = None,
    **work: Any,
) -> JsonResponse:
    """:func:`hand_off` for an async view: it runs in the thread of the view's transaction."""
    call = functools.partial(
        hand_off, request, topic, hold_seconds=hold_seconds, status_url=status_url, **work
    )
    return await sync_to_async(call, thread_sensitive=True)()


def handed_off(func: Callable[P, Any]) -> Callable[P, str]:
    """Make a task the worker of handed-off requests: each delivery runs ``func`` at most once
    per key, in the transaction that stores its final response.

    ``func`` gets the work's keyword arguments (and whatever else the task is called with, such
    as a bound Celery task's ``self``) and returns the final response: a Django
    ``HttpResponse`` (``JsonResponse(data, status=201)``), or any JSON value, answered 200. The
    task returns what became of the delivery (:class:`HandOffOutcome`'s value): a redelivery of
    completed work, or work whose key was taken over meanwhile, runs nothing. If ``func``
    raises, nothing is stored, the key stays held and the exception propagates, for the task's
    own retries. If it marks its transaction for rollback (``set_rollback``, or a database
    error it caught) and returns, nothing is stored and the key is released, as for a view.
    """

    @functools.wraps(func)
    def worker(*args: P.args, **kwargs: P.kwargs) -> str:
        ticket = kwargs.pop(HAND_OFF_ARGUMENT, None)
        if not isinstance(ticket, dict):
            raise TypeError(
                f"{func.__qualname__} runs work handed off by hand_off(); it was called "
                f"without its {HAND_OFF_ARGUMENT!r} argument."
            )
        ran = run_step(
            _lease(ticket),
            functools.partial(rendered, lambda: _as_response(func(*args, **kwargs))),
            _final,
            handed_off=True,
        )
        return _OUTCOMES[ran.ended].value

    return worker


def lease_of(work: Mapping[str, Any]) -> Lease:
    """The lease a task's keyword arguments carry (before :func:`handed_off` takes it off): for
    ``derived_key()``, a stable key for a call to another service that the task makes before
    its own transaction, the same for every delivery of the work."""
    ticket = work.get(HAND_OFF_ARGUMENT)
    if not isinstance(ticket, dict):
        raise TypeError(f"these keyword arguments carry no {HAND_OFF_ARGUMENT!r}.")
    return _lease(ticket)


def _status_url(key: str) -> str:
    try:
        return reverse(STATUS_URL_NAME, kwargs={"key": key})
    except NoReverseMatch:
        raise ImproperlyConfigured(
            "hand_off() answers 202 with the key's status URL: include "
            "django_idempotency.urls in your URLconf (docs/howto/status-by-key.md), or pass "
            "status_url=."
        ) from None


def _ticket(lease: Lease, hold_seconds: float) -> dict[str, Any]:
    """What the worker needs to take the key up: the key, its owner token, and the terms."""
    identity = lease.identity
    return {
        "using": lease.using,
        "scope": identity.scope,
        "key": identity.key,
        "fingerprint": identity.fingerprint,
        "method": identity.method,
        "path": identity.path,
        "owner_token": str(lease.owner_token),
        "attempt": lease.attempt,
        "hold_seconds": hold_seconds,
        "ttl_seconds": lease.ttl_seconds,
    }


def _lease(ticket: dict[str, Any]) -> Lease:
    identity = Identity(
        scope=ticket["scope"],
        key=ticket["key"],
        fingerprint=ticket["fingerprint"],
        method=ticket["method"],
        path=ticket["path"],
    )
    return Lease(
        identity,
        uuid.UUID(ticket["owner_token"]),
        # Not known here and not needed: the worker's statements take the database's time.
        datetime.max,
        int(ticket["attempt"]),
        ticket["using"],
        lease_seconds=float(ticket["hold_seconds"]),
        ttl_seconds=ticket["ttl_seconds"],
    )


def _final(response: HttpResponseBase) -> Keep:
    """Whatever the worker returns (from a transaction it did not roll back) is final."""
    return Keep(capture(response))


def _as_response(result: Any) -> HttpResponseBase:
    if isinstance(result, HttpResponseBase):
        return result
    return JsonResponse(result, safe=False, encoder=DjangoJSONEncoder)
