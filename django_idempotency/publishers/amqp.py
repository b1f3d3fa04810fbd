"""Publishes to an AMQP exchange (RabbitMQ) through kombu, with publisher confirms.

The whole batch is written, then the confirms are awaited together: one round trip per batch
rather than per message. ``message_id`` is the event id, the routing key is the topic, messages
are persistent, and ``mandatory`` makes an unroutable message a failure instead of a silent drop.

The broker's refusals of the route (ACCESS_REFUSED: a login or a permission; NOT_FOUND: no such
exchange; NOT_ALLOWED: no such virtual host; PRECONDITION_FAILED: the exchange exists with
other arguments) are a ``BrokerConfigurationError``, apart from an unreachable broker.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    IdempotencyConfigurationError,
    PublishError,
)
from django_idempotency.publishers.base import OutboxMessage, Publisher, to_json

__all__ = ["AMQPPublisher", "Confirms", "PERSISTENT"]

PERSISTENT = 2


def _kombu() -> Any:
    """kombu, imported on first use (it is an optional dependency) and typed loosely."""
    import kombu

    return kombu


def _refusals() -> tuple[type[Exception], ...]:
    """py-amqp's errors for a broker that answered and refused the route."""
    from amqp import exceptions

    return (
        exceptions.AccessRefused,
        exceptions.NotFound,
        exceptions.NotAllowed,
        exceptions.PreconditionFailed,
    )


class Confirms:
    """The publisher confirms of one channel: a delivery tag per message sent, the broker's
    verdicts noted as its acks and nacks arrive, and a batch's awaited together.

    Tags restart at 1 on a new channel, so a new channel needs a new ``Confirms``. Only awaited
    tags are recorded, so a late or "multiple" ack never piles up entries.
    """

    def __init__(self, channel: Any) -> None:
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        self._next_tag = 0
        self.pending: set[int] = set()
        self.settled: dict[int, bool] = {}

    def sent(self) -> int:
        """The tag of the message just published on the channel."""
        self._next_tag += 1
        self.pending.add(self._next_tag)
        return self._next_tag

    def _settle(self, delivery_tag: int, multiple: bool, ok: bool) -> None:
        if multiple:
            tags = [tag for tag in self.pending if tag <= delivery_tag]
        else:
            tags = [delivery_tag] if delivery_tag in self.pending else []
        for tag in tags:
            self.pending.discard(tag)
            self.settled[tag] = ok

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, True)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, False)

    def wait(self, connection: Any, tags: Sequence[int], timeout: float) -> None:
        """Read the broker's answers until each of ``tags`` has one, or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while any(tag in self.pending for tag in tags):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                connection.drain_events(timeout=remaining)
            except TimeoutError:
                return

    def verdict(self, tag: int) -> bool | None:
        """True (ack), False (nack) or None (no answer: a failure too), forgetting the tag."""
        self.pending.discard(tag)
        return self.settled.pop(tag, None)


class AMQPPublisher(Publisher):
    """``OPTIONS``: ``url`` (required), ``exchange`` (required), ``exchange_type`` ("topic"),
    ``declare`` (True: declare the exchange durable), ``mandatory`` (True),
    ``confirm_timeout`` (10 s), ``connect_timeout`` (5 s)."""

    def __init__(
        self,
        *,
        url: str,
        exchange: str,
        exchange_type: str = "topic",
        declare: bool = True,
        mandatory: bool = True,
        confirm_timeout: float = 10.0,
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        if not url or not exchange:
            raise IdempotencyConfigurationError(
                "AMQPPublisher needs OPTIONS 'url' (amqp://...) and 'exchange' (a name)."
            )
        self.url = url
        self.exchange = exchange
        self.exchange_type = exchange_type
        self.declare = declare
        self.mandatory = mandatory
        self.confirm_timeout = confirm_timeout
        self.connect_timeout = connect_timeout
        self._connection: Any = None
        self._channel: Any = None
        self._confirms: Confirms | None = None
        self._returned: dict[str, str] = {}

    # --- connection ---------------------------------------------------------------------------

    def _connect(self) -> None:
        kombu = _kombu()
        connection = kombu.Connection(self.url, connect_timeout=self.connect_timeout)
        try:
            connection.connect()
            channel = connection.channel()
            confirms = Confirms(channel)
            channel.events["basic_return"].add(self._on_return)
            if self.declare:
                kombu.Exchange(self.exchange, type=self.exchange_type, durable=True).declare(
                    channel=channel
                )
        except BaseException:
            connection.close()
            raise
        # Tags restart at 1 on a new channel: forget everything about the old one.
        self._connection, self._channel, self._confirms = connection, channel, confirms
        self._returned.clear()

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            # A dead socket cannot be closed politely; drop it.
            with contextlib.suppress(Exception):
                connection.close()

    # --- returns ------------------------------------------------------------------------------

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        # RabbitMQ sends basic.return before the basic.ack of the same message, so the ack that
        # follows must not count as success: remember the message id.
        message_id = message.properties.get("message_id")
        if message_id:
            self._returned[str(message_id)] = f"unroutable: no queue bound for {routing_key!r}"

    # --- publishing ---------------------------------------------------------------------------

    def publish(self, message: OutboxMessage) -> None:
        error = self.publish_many([message])[0]
        if error is not None:
            raise error

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        errors = _kombu().Connection(self.url).connection_errors + (OSError,)
        failure: PublishError
        try:
            if self._connection is None:
                self._connect()
            sent = self._send(messages)
            self._await_confirms(sent)
        except _refusals() as exc:
            # The broker's reply text names the login mechanism, exchange or vhost, never a
            # password. The channel (or connection) is closed: start over next batch.
            self.close()
            failure = BrokerConfigurationError(f"AMQP broker refused the route: {exc}")
            return [failure] * len(messages)
        except errors as exc:
            self.close()
            failure = BrokerUnavailable(f"AMQP broker unreachable: {exc!r}")
            return [failure] * len(messages)
        except Exception:
            # A channel error (exchange missing, access refused) closes the channel: start over
            # next batch with a fresh connection.
            self.close()
            raise
        return [self._outcome(tag, message) for tag, message in sent]

    def _send(self, messages: Sequence[OutboxMessage]) -> list[tuple[int, OutboxMessage]]:
        channel = self._channel
        sent: list[tuple[int, OutboxMessage]] = []
        for message in messages:
            amqp_message = channel.prepare_message(
                to_json(message.payload),
                content_type="application/json",
                content_encoding="utf-8",
                headers={
                    **message.headers,
                    "event_id": str(message.event_id),
                    "event_key": message.key,
                    **message.trace_headers(),
                },
                properties={
                    "message_id": str(message.event_id),
                    "delivery_mode": PERSISTENT,
                    "type": message.topic,
                    "timestamp": int(message.created_at.timestamp())
                    if message.created_at
                    else None,
                },
            )
            channel.basic_publish(
                amqp_message,
                exchange=self.exchange,
                routing_key=message.topic,
                mandatory=self.mandatory,
            )
            sent.append((self._confirms_of_channel().sent(), message))
        return sent

    def _confirms_of_channel(self) -> Confirms:
        assert self._confirms is not None, "publish_many connects first"
        return self._confirms

    def _await_confirms(self, sent: list[tuple[int, OutboxMessage]]) -> None:
        tags = [tag for tag, _ in sent]
        self._confirms_of_channel().wait(self._connection, tags, self.confirm_timeout)

    def _outcome(self, tag: int, message: OutboxMessage) -> BaseException | None:
        ok = self._confirms_of_channel().verdict(tag)  # no answer by now counts as a failure
        returned = self._returned.pop(str(message.event_id), None)
        if returned is not None:
            return PublishError(returned)
        if ok is None:
            return PublishError(f"no publisher confirm within {self.confirm_timeout} s")
        if not ok:
            return PublishError("the broker refused the message (basic.nack)")
        return None
