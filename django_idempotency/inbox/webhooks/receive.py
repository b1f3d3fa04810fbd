"""``@idempotent_webhook``: an inbound webhook verified, then handled once per event id.

A sender (Stripe, GitHub, any Standard Webhooks sender) delivers each event at least once and
tells the receiver to deduplicate by its event id. The decorated view does, in this order:

1. refuses anything but POST (405), a body over ``max_body`` (413, unread when its
   Content-Length says so), and whatever the provider refuses: a bad or missing signature, a
   stale timestamp, a malformed event id (400, problem+json). Nothing is stored for these.
2. hands the event id to the inbox (:func:`~django_idempotency.inbox.consume_once`): its
   ``ProcessedMessage`` marker is inserted first, in the transaction the handler's writes then
   join, so both commit or neither does. A delivery of an event already handled answers 200 at
   once without running the handler; a concurrent delivery of the same event waits for the
   first one's transaction on the marker's unique key, then answers 200 too (or runs, if the
   first rolled back).
3. runs the handler. It raises: its writes and the marker roll back, the failure is recorded
   for the admin's failure groups, and the exception reaches Django (500), so the sender
   retries. It answers 4xx or 5xx, or marks its transaction for rollback: the same, with its
   own answer (a 500 for a rollback). It answers anything else (None is an empty 200): all of
   it commits.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import connections
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseNotAllowed,
    JsonResponse,
)
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.conf import conf
from django_idempotency.exceptions import (
    IdempotencyError,
    WebhookBodyTooLarge,
    WebhookRejected,
)
from django_idempotency.inbox.consumers import Consumption, consume_once
from django_idempotency.inbox.webhooks.providers import Delivery, Provider
from django_idempotency.request import lifecycle
from django_idempotency.request.middleware import idempotency_exempt
from django_idempotency.request.responses import PROBLEM_CONTENT_TYPE, problem_response

__all__ = ["WebhookEvent", "WebhookNotHandled", "default_consumer", "idempotent_webhook"]

logger = logging.getLogger(__name__)

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])

_MAX_CONSUMER = 255


@dataclass(frozen=True, slots=True)
class WebhookEvent:
    """What the handler is given beside the request: the verified event."""

    #: The provider's name (``"stripe"``, ``"github"``, ``"standard-webhooks"``, …).
    provider: str
    #: The sender's event id: what the inbox deduplicates on.
    id: str
    #: The event's type, when the sender says (Stripe's ``type``, ``X-GitHub-Event``, …).
    type: str | None
    #: The body parsed as JSON; None when it is not JSON.
    payload: Any
    #: The body as it was signed.
    body: bytes
    #: The inbox's consumption of this event (``next_event_id()`` for events it publishes).
    consumption: Consumption


class WebhookNotHandled(IdempotencyError):
    """The handler answered an error or rolled its transaction back: nothing was marked
    processed, and this is the failure the inbox records for the event."""

    def __init__(self, reason: str, response: HttpResponseBase) -> None:
        super().__init__(reason)
        self.response = response


def idempotent_webhook(
    provider: Provider,
    *,
    consumer: str | None = None,
    max_body: int | None = None,
    using: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a view receive ``provider``'s webhooks, verified, each event handled once::

        @idempotent_webhook(Stripe(secret=lambda: settings.STRIPE_WEBHOOK_SECRET))
        def stripe_webhook(request, event):
            if event.type == "payment_intent.succeeded":
                Payment.objects.filter(intent=event.payload["data"]["object"]["id"]).update(...)

    The handler is called as ``handler(request, event, *args, **kwargs)`` with a
    :class:`WebhookEvent`, inside the transaction that marks the event processed; it may be
    ``async def`` (it then runs in the thread Django's async ORM calls use, so its database calls
    share that transaction). The view is exempt from CSRF (senders send no token), from
    ``IdempotencyMiddleware`` (senders send no key: the event id is the key) and from
    ``ATOMIC_REQUESTS`` (the inbox opens the transaction, and those of the other
    ``ATOMIC_REQUESTS`` databases inside it).

    ``consumer``: the inbox's name for this endpoint; by default ``webhook:<provider>:<the
    handler's dotted path>``. Name it to keep it across a rename. ``max_body``: the largest body
    accepted, in bytes (default: ``DATA_UPLOAD_MAX_MEMORY_SIZE``, read on each delivery, which
    also bounds a larger ``max_body``: raise the setting for bodies above it).
    ``using``: the database of the inbox (default: where the router writes ``ProcessedMessage``).
    """

    def decorate(handler: Callable[..., Any]) -> Callable[..., Any]:
        name = consumer or default_consumer(provider, handler)
        if iscoroutinefunction(handler):
            call = async_to_sync(handler)

            async def async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                received = _receive(request, provider, max_body)
                if isinstance(received, HttpResponseBase):
                    return received
                handle = sync_to_async(_handle, thread_sensitive=True)
                return await handle(request, received, name, call, handler, using, args, kwargs)

            view: Callable[..., Any] = functools.wraps(handler)(async_view)
        else:

            def sync_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                received = _receive(request, provider, max_body)
                if isinstance(received, HttpResponseBase):
                    return received
                return _handle(request, received, name, handler, handler, using, args, kwargs)

            view = functools.wraps(handler)(sync_view)
        return lifecycle.opt_out_of_atomic_requests(idempotency_exempt(csrf_exempt(view)))

    return decorate


def default_consumer(provider: Provider, handler: Callable[..., Any]) -> str:
    """``webhook:<provider>:<module>.<qualname>``, hashed when longer than the inbox holds."""
    name = f"webhook:{provider.name}:{handler.__module__}.{handler.__qualname__}"
    if len(name) > _MAX_CONSUMER:
        name = f"webhook:{provider.name}:sha256:{hashlib.sha256(name.encode()).hexdigest()}"
    return name


@dataclass(frozen=True, slots=True)
class _Received:
    delivery: Delivery
    body: bytes
    provider: str


def _receive(
    request: HttpRequest, provider: Provider, max_body: int | None
) -> _Received | HttpResponseBase:
    """The checks before anything is stored: the method, the body's size, the provider's."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    try:
        body = _read_body(request, max_body)
        delivery = provider.receive(request, body)
    except WebhookRejected as rejected:
        logger.info(
            "webhook rejected",
            extra={"provider": provider.name, "error": rejected.default_code, "path": request.path},
        )
        return problem_response(rejected)
    return _Received(delivery, body, provider.name)


def _read_body(request: HttpRequest, max_body: int | None) -> bytes:
    bound = settings.DATA_UPLOAD_MAX_MEMORY_SIZE if max_body is None else max_body
    if bound is None:
        return request.body
    declared = request.META.get("CONTENT_LENGTH") or ""
    if declared.isdigit() and int(declared) > bound:
        raise WebhookBodyTooLarge()  # unread
    try:
        body = request.body
    except RequestDataTooBig as exc:  # above Django's own DATA_UPLOAD_MAX_MEMORY_SIZE
        raise WebhookBodyTooLarge() from exc
    if len(body) > bound:
        raise WebhookBodyTooLarge()
    return body


def _handle(
    request: HttpRequest,
    received: _Received,
    consumer: str,
    call: Callable[..., Any],
    handler: Callable[..., Any],
    using: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> HttpResponseBase:
    delivery = received.delivery
    try:
        with consume_once(consumer, delivery.id, using=using) as consumption:
            if not consumption:
                return JsonResponse({"duplicate": True})
            event = WebhookEvent(
                provider=received.provider,
                id=delivery.id,
                type=delivery.type,
                payload=delivery.payload,
                body=received.body,
                consumption=consumption,
            )
            with lifecycle.atomic_requests(handler):
                response = _response(call(request, event, *args, **kwargs))
                # Read inside the innermost transactions: leaving a savepoint that was marked
                # for rollback clears the mark, and the marker would commit without the work.
                if any(db.needs_rollback for db in connections.all(initialized_only=True)):
                    raise WebhookNotHandled(
                        "the handler marked its transaction for rollback", _rolled_back()
                    )
            if response.status_code >= 400:
                raise WebhookNotHandled(f"the handler answered {response.status_code}", response)
    except WebhookNotHandled as not_handled:
        return not_handled.response
    return response


def _response(value: object) -> HttpResponseBase:
    if value is None:
        return HttpResponse(status=200)
    if not isinstance(value, HttpResponseBase):
        raise TypeError(
            f"An @idempotent_webhook handler returns an HttpResponse or None, not {value!r}."
        )
    return value


def _rolled_back() -> HttpResponse:
    """A 500 the sender retries: the handler's work rolled back, its answer is not the truth."""
    return JsonResponse(
        {
            "type": f"{conf.ERROR_TYPE_BASE}webhook_not_handled",
            "title": "Webhook not handled",
            "status": 500,
            "detail": "The handler rolled its work back; nothing was marked processed.",
            "error": "webhook_not_handled",
            "message": "Deliver the event again.",
        },
        status=500,
        content_type=PROBLEM_CONTENT_TYPE,
    )
