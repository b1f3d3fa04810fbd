"""Sends each event as a Celery task whose task id is the event id.

The outbox, the broker and the consumer's inbox then all speak of one id: a republished event
arrives as the same task id, and ``@idempotent_consumer`` skips it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from django_idempotency.conf import import_setting
from django_idempotency.exceptions import BrokerUnavailable, PublishError
from django_idempotency.publishers.amqp import Confirms
from django_idempotency.publishers.base import OutboxMessage, Publisher

__all__ = ["CeleryPublisher", "EVENT_ID_HEADER", "EVENT_KEY_HEADER", "EVENT_TOPIC_HEADER"]

#: Message headers every task sent by this publisher carries.
EVENT_ID_HEADER = "event_id"
EVENT_TOPIC_HEADER = "event_topic"
EVENT_KEY_HEADER = "event_key"


class CeleryPublisher(Publisher):
    """``OPTIONS``: ``app`` (dotted path to your Celery app; default ``celery.current_app``),
    ``task`` (task name; default the topic), and any ``apply_async`` option such as ``queue``.

    A dict payload becomes the task's keyword arguments, anything else its one argument. Turn on
    publisher confirms with ``CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}``:
    on RabbitMQ (the py-amqp transport) a batch is then sent whole and its confirms awaited
    together (up to ``confirm_timeout``, 10 s), where Celery alone waits for each task's.
    """

    def __init__(
        self,
        *,
        app: Any = None,
        task: str | None = None,
        confirm_timeout: float = 10.0,
        **send_options: Any,
    ) -> None:
        super().__init__()
        self.app_path = app
        self.task = task
        self.confirm_timeout = confirm_timeout
        self.send_options = send_options
        # The connection, channel and producer of batches sent with confirms awaited together.
        self._connection: Any = None
        self._confirms: Confirms | None = None
        self._producer: Any = None

    def _app(self) -> Any:
        if self.app_path is not None:
            return import_setting("OUTBOX_PUBLISHERS (CeleryPublisher 'app')", self.app_path)
        from celery import current_app

        return current_app

    def publish(self, message: OutboxMessage) -> None:
        self._send(self._app(), message, producer=None)

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        """The batch through one producer, taken from the app's pool once: one connection and
        channel for all of it, where ``send_task`` alone takes and returns one per message.
        With publisher confirms on RabbitMQ, the confirms are awaited once for the batch."""
        from kombu.exceptions import OperationalError

        app = self._app()
        if _confirms_each_publish(app):
            return self._publish_confirmed(app, messages)
        results: list[BaseException | None] = []
        try:
            with app.producer_or_acquire() as producer:
                for index, message in enumerate(messages):
                    try:
                        self._send(app, message, producer=producer)
                    except BrokerUnavailable as exc:
                        results.extend([exc] * (len(messages) - index))
                        break
                    except Exception as exc:
                        results.append(exc)
                    else:
                        results.append(None)
        except OperationalError as exc:  # no connection to take the producer from
            unavailable = BrokerUnavailable(f"Celery broker unreachable: {exc}")
            results.extend([unavailable] * (len(messages) - len(results)))
        return results

    def _publish_confirmed(
        self, app: Any, messages: Sequence[OutboxMessage]
    ) -> list[BaseException | None]:
        """Send the whole batch on a channel of our own, then await its confirms together."""
        connection_errors = app.connection_for_write().connection_errors + (OSError,)
        sent: list[int] = []
        results: list[BaseException | None] = []
        try:
            if self._connection is None:
                self._connect(app)
            confirms = self._confirms
            assert confirms is not None
            for message in messages:
                try:
                    self._send(app, message, producer=self._producer)
                except BrokerUnavailable:
                    raise
                except Exception as exc:
                    results.append(exc)
                    sent.append(0)
                else:
                    results.append(None)
                    sent.append(confirms.sent())
            confirms.wait(self._connection, [tag for tag in sent if tag], self.confirm_timeout)
        except (*connection_errors, BrokerUnavailable) as exc:
            self.close()
            unavailable = BrokerUnavailable(f"Celery broker unreachable: {exc!r}")
            return [unavailable] * len(messages)
        return [
            error if error is not None else _confirmed(confirms.verdict(tag), self.confirm_timeout)
            for tag, error in zip(sent, results, strict=True)
        ]

    def _connect(self, app: Any) -> None:
        # Celery's own confirm_publish would wait for each message: off on this connection,
        # where the confirms are turned on by hand and awaited per batch.
        options = {**(app.conf.broker_transport_options or {}), "confirm_publish": False}
        connection = app.connection_for_write(transport_options=options)
        try:
            connection.connect()
            channel = connection.channel()
            confirms = Confirms(channel)
            producer = app.amqp.Producer(channel)
        except BaseException:
            connection.close()
            raise
        self._connection, self._confirms, self._producer = connection, confirms, producer

    def close(self) -> None:
        connection, self._connection, self._confirms, self._producer = (
            self._connection,
            None,
            None,
            None,
        )
        if connection is not None:
            with contextlib.suppress(Exception):  # a dead socket cannot be closed politely
                connection.close()

    def _send(self, app: Any, message: OutboxMessage, *, producer: Any) -> None:
        from kombu.exceptions import OperationalError

        if isinstance(message.payload, dict):
            args: tuple[Any, ...] = ()
            kwargs: dict[str, Any] = message.payload
        else:
            args, kwargs = (message.payload,), {}
        headers = {
            **message.headers,
            EVENT_ID_HEADER: str(message.event_id),
            EVENT_TOPIC_HEADER: message.topic,
            EVENT_KEY_HEADER: message.key,
            **message.trace_headers(),
        }
        try:
            # retry=False: the relay's backoff is the retry policy; a blocking reconnect loop
            # here would only eat the relay's lease.
            app.send_task(
                self.task or message.topic,
                args=args,
                kwargs=kwargs,
                task_id=str(message.event_id),
                headers=headers,
                retry=False,
                producer=producer,
                **self.send_options,
            )
        except OperationalError as exc:
            raise BrokerUnavailable(f"Celery broker unreachable: {exc}") from exc
        except Exception as exc:
            raise PublishError(f"send_task failed: {exc!r}") from exc


def _confirms_each_publish(app: Any) -> bool:
    """Whether the app asks for publisher confirms on RabbitMQ through py-amqp, where Celery
    would wait for each message's confirm in turn."""
    options = app.conf.broker_transport_options or {}
    if not options.get("confirm_publish"):
        return False
    return bool(app.connection_for_write().transport.driver_type == "amqp")


def _confirmed(verdict: bool | None, timeout: float) -> BaseException | None:
    if verdict is None:
        return PublishError(f"no publisher confirm within {timeout} s")
    if not verdict:
        return PublishError("the broker refused the message (basic.nack)")
    return None
