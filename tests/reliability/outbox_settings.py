"""Settings of the relay processes the outbox fault tests start: AMQP to the private node.

``REL_AMQP_URL`` and ``REL_EXCHANGE`` name the broker and exchange; ``REL_LEASE_SECONDS`` the
relay lease. Retries back off to at most ``REL_BACKOFF_MAX_SECONDS`` so a test's outage of a few
seconds is followed by a retry within seconds, and the attempt budget outlasts the outage:
events only go DEAD when an outage outlives the budget, and that is not what these tests test.
"""

import os

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENCY

IDEMPOTENCY = {
    **IDEMPOTENCY,
    "OUTBOX_RELAY_LEASE_SECONDS": float(os.environ.get("REL_LEASE_SECONDS", "60")),
    "OUTBOX_BACKOFF_BASE_SECONDS": 0.5,
    "OUTBOX_BACKOFF_MAX_SECONDS": float(os.environ.get("REL_BACKOFF_MAX_SECONDS", "4")),
    "OUTBOX_MAX_ATTEMPTS": 1000,
    "OUTBOX_PUBLISHERS": {
        "*": {
            "BACKEND": "django_idempotency.publishers.amqp.AMQPPublisher",
            "OPTIONS": {
                "url": os.environ.get("REL_AMQP_URL", ""),
                "exchange": os.environ.get("REL_EXCHANGE", ""),
                "confirm_timeout": 5.0,
                "connect_timeout": 2.0,
            },
        }
    },
}
# The relay's warnings (publish failures, lost leases) go to its output, which the test reads.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"django_idempotency": {"handlers": ["stderr"], "level": "WARNING"}},
}
