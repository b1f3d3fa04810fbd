"""Layer 2, idempotent consumers: a processed-message marker in the handler's own transaction;
inbound webhooks (``inbox.webhooks``) are consumers of their sender's events."""

from django_idempotency.inbox.consumers import (
    Consumption,
    consume_once,
    derived_event_id,
    idempotent_consumer,
)
from django_idempotency.inbox.webhooks import idempotent_webhook

__all__ = [
    "Consumption",
    "consume_once",
    "derived_event_id",
    "idempotent_consumer",
    "idempotent_webhook",
]
