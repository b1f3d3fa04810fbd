"""Layer 2, idempotent consumers: a processed-message marker in the handler's own transaction."""

from django_idempotency.inbox.consumers import (
    Consumption,
    consume_once,
    derived_event_id,
    idempotent_consumer,
)

__all__ = [
    "Consumption",
    "consume_once",
    "derived_event_id",
    "idempotent_consumer",
]
