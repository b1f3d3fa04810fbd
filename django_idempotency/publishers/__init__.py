"""Publishers hand outbox events to a broker; ``OUTBOX_PUBLISHERS`` routes each topic to one.

Built in: :class:`~.celery.CeleryPublisher`, :class:`~.amqp.AMQPPublisher`,
:class:`~.webhook.WebhookPublisher`, :class:`~.log.LoggingPublisher` and
:class:`~.memory.MemoryPublisher` (tests). A publisher of your own subclasses :class:`Publisher`.
"""

from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.publishers.routing import PublisherSet, resolve_route

__all__ = ["OutboxMessage", "Publisher", "PublisherSet", "resolve_route"]
