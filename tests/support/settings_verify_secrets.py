"""The test settings with publisher routes that hold secrets, each on a port where nothing
listens: the project ``idempotency_verify``'s killed relay loads in the secrets test."""

from typing import Any

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENCY

#: Each of these must stay out of the command line and environment of every child process.
WEBHOOK_PASSWORD = "wh-pa55-7c1e9a"
WEBHOOK_TOKEN = "wh-tok-3b8d02"
SIGNING_SECRET = "whsec_c2lnbmluZy01ZjBhNGM="  # base64 of "signing-5f0a4c"
NATS_PASSWORD = "nats-pa55-e61b"
NATS_TOKEN = "nats-tok-92fd"
AMQP_PASSWORD = "amqp-pa55-0d7c"
SECRETS = (
    WEBHOOK_PASSWORD,
    WEBHOOK_TOKEN,
    SIGNING_SECRET,
    NATS_PASSWORD,
    NATS_TOKEN,
    AMQP_PASSWORD,
)

ROUTES: dict[str, Any] = {
    "verify.webhook": {
        "BACKEND": "django_idempotency.publishers.webhook.WebhookPublisher",
        "OPTIONS": {
            "url": f"http://hooks:{WEBHOOK_PASSWORD}@127.0.0.1:1/in/{WEBHOOK_TOKEN}"
            f"?token={WEBHOOK_TOKEN}",
            "secret": SIGNING_SECRET,
            "timeout": 1,
        },
    },
    "verify.nats": {
        "BACKEND": "django_idempotency.publishers.nats.NATSPublisher",
        "OPTIONS": {
            "servers": f"nats://relay:{NATS_PASSWORD}@127.0.0.1:1",
            "connect_timeout": 1,
            "connect_options": {"token": NATS_TOKEN},
        },
    },
    "verify.amqp": {
        "BACKEND": "django_idempotency.publishers.amqp.AMQPPublisher",
        "OPTIONS": {
            "url": f"amqp://relay:{AMQP_PASSWORD}@127.0.0.1:1//",
            "exchange": "verify",
            "connect_timeout": 1,
        },
    },
}

IDEMPOTENCY = {**IDEMPOTENCY, "OUTBOX_PUBLISHERS": {**ROUTES, **IDEMPOTENCY["OUTBOX_PUBLISHERS"]}}
