"""Sends each event as a Celery task whose task id is the event id.

The outbox, the broker and the consumer's inbox then all speak of one id: a republished event
arrives as the same task id, and ``@idempotent_consumer`` skips it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django_idempotency.conf import import_setting
from django_idempotency.exceptions import BrokerUnavailable, PublishError
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
    publisher confirms with ``CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}``.
    """

    def __init__(self, *, app: Any = None, task: str | None = None, **send_options: Any) -> None:
        super().__init__()
        self.app_path = app
        self.task = task
        self.send_options = send_options

    def _app(self) -> Any:
        if self.app_path is not None:
            return import_setting("OUTBOX_PUBLISHERS (CeleryPublisher 'app')", self.app_path)
        from celery import current_app

        return current_app

    def publish(self, message: OutboxMessage) -> None:
        self._send(self._app(), message, producer=None)

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        """The batch through one producer, taken from the app's pool once: one connection and
        channel for all of it, where ``send_task`` alone takes and returns one per message."""
        from kombu.exceptions import OperationalError

        app = self._app()
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
