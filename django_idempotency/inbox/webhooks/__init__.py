"""Inbound webhooks exactly once: the sender verified (``providers``), then each event handled
once through the inbox, in the handler's transaction (``receive``)."""

from django_idempotency.inbox.webhooks.providers import (
    CustomProvider,
    Delivery,
    GitHub,
    Provider,
    Secret,
    StandardWebhooks,
    Stripe,
)
from django_idempotency.inbox.webhooks.receive import (
    WebhookEvent,
    WebhookNotHandled,
    idempotent_webhook,
)

__all__ = [
    "CustomProvider",
    "Delivery",
    "GitHub",
    "Provider",
    "Secret",
    "StandardWebhooks",
    "Stripe",
    "WebhookEvent",
    "WebhookNotHandled",
    "idempotent_webhook",
]
