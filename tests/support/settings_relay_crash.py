"""Test settings for a relay process that publishes to RabbitMQ and then hangs until killed."""

import os

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENCY

IDEMPOTENCY = {
    **IDEMPOTENCY,
    "OUTBOX_RELAY_LEASE_SECONDS": float(os.environ.get("CRASH_LEASE_SECONDS", "2")),
    "OUTBOX_PUBLISHERS": {
        "*": {
            "BACKEND": "tests.support.crash_publisher.PublishThenHang",
            "OPTIONS": {
                "url": os.environ.get("AMQP_URL", ""),
                "exchange": os.environ.get("CRASH_EXCHANGE", ""),
                "marker": os.environ.get("CRASH_MARKER", ""),
            },
        }
    },
}
