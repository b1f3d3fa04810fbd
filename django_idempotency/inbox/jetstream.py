"""Idempotent consumers for NATS JetStream pull subscriptions (nats-py).

Each message runs its handler inside :func:`~django_idempotency.inbox.consumers.consume_once`,
and is acknowledged only once that transaction (the processed-message marker and the handler's
writes) has committed. A consumer that dies before the ack gets the message again after the
consumer's ``ack_wait``, finds the marker and acknowledges it without running the handler; a
handler that raises rolls its marker back and the message is negatively acknowledged, so it is
delivered again. JetStream redelivers; the marker makes the effect happen once.

The message id is the ``Nats-Msg-Id`` header, which :class:`~django_idempotency.publishers.nats.
NATSPublisher` sets to the outbox event id, so the outbox, the stream and the inbox speak of one
id; a message published without it is known by its stream and stream sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from django_idempotency.inbox.consumers import consume_once
from django_idempotency.observability import tracing

__all__ = ["MSG_ID_HEADER", "handle_once", "message_id", "run_pull_consumer"]

logger = logging.getLogger(__name__)

#: The header JetStream deduplicates on, and the message id here.
MSG_ID_HEADER = "Nats-Msg-Id"

Handler = Callable[[Any], Any]


def message_id(msg: Any) -> str:
    """``Nats-Msg-Id`` when the message has it, else ``<stream>:<stream sequence>``: the same
    on every redelivery either way."""
    headers = msg.headers or {}
    if headers.get(MSG_ID_HEADER):
        return str(headers[MSG_ID_HEADER])
    metadata = msg.metadata
    return f"{metadata.stream}:{metadata.sequence.stream}"


def _run_once(
    msg: Any, handler: Handler, consumer: str, using: str | None, identifier: str
) -> bool:
    """In a worker thread: the handler and its marker in one transaction; False if a duplicate."""
    close_old_connections()  # a long-lived consumer outlives CONN_MAX_AGE and broken connections
    traceparent = (msg.headers or {}).get(tracing.TRACEPARENT)
    with consume_once(consumer, identifier, using=using, traceparent=traceparent) as consumption:
        if not consumption:
            return False
        handler(msg)
    return True


async def handle_once(
    msg: Any,
    handler: Handler,
    *,
    consumer: str,
    using: str | None = None,
    nak_delay: float | None = None,
) -> bool:
    """Run ``handler(msg)`` at most once per message id for ``consumer``, then ack ``msg``.

    ``handler`` is a plain (sync) function; it runs in Django's thread for sync code, inside
    the marker's transaction, so its ORM writes commit with the marker or not at all. It must
    not call the message's own (async) methods. Returns False for a duplicate, which is acked
    without running. When ``handler`` raises, ``msg`` is nak'ed (redelivered after ``nak_delay``
    seconds, or the consumer's backoff) and the error propagates.
    """
    identifier = message_id(msg)
    try:
        ran = await sync_to_async(_run_once, thread_sensitive=True)(
            msg, handler, consumer, using, identifier
        )
    except Exception:
        # The marker rolled back with the handler's writes: ask for the message again (if the
        # nak is lost too, the consumer's ack_wait brings the message back anyway).
        with contextlib.suppress(Exception):
            await msg.nak(delay=nak_delay)
        raise
    # Only now, with the marker committed: a lost ack costs a redelivery, which the marker skips.
    await msg.ack()
    return ran


async def run_pull_consumer(
    subscription: Any,
    handler: Handler,
    *,
    consumer: str,
    using: str | None = None,
    batch: int = 10,
    fetch_timeout: float = 5.0,
    nak_delay: float | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Fetch from a JetStream pull ``subscription`` and :func:`handle_once` each message, until
    ``stop`` is set. A handler's error is logged and the loop goes on (the message was nak'ed).
    A fetch that times out is an empty batch."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            messages = await subscription.fetch(batch, timeout=fetch_timeout)
        except TimeoutError:
            # Every way nats-py says "nothing arrived in time": its TimeoutError and
            # FetchTimeoutError subclass asyncio.TimeoutError (the builtin since Python 3.11),
            # and since 2.15 fetch() also raises a bare asyncio.TimeoutError when the server's
            # 408 for the no-wait probe arrives as the deadline passes.
            continue
        for msg in messages:
            try:
                await handle_once(msg, handler, consumer=consumer, using=using, nak_delay=nak_delay)
            except Exception:
                logger.exception(
                    "JetStream message handler failed; the message will be redelivered",
                    extra={"consumer": consumer, "message_id": message_id(msg)},
                )
