"""Test settings for a relay process that writes what it publishes to a file
(tests/support/crash_publisher.py), for tests that break its database under it."""

import os

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENCY

IDEMPOTENCY = {
    **IDEMPOTENCY,
    "OUTBOX_RELAY_LEASE_SECONDS": float(os.environ.get("REL_LEASE_SECONDS", "60")),
    "OUTBOX_PUBLISHERS": {
        "*": {
            "BACKEND": os.environ.get(
                "REL_PUBLISHER", "tests.support.crash_publisher.FilePublisher"
            ),
            "OPTIONS": {
                "path": os.environ.get("REL_SENT_FILE", ""),
                "hold_file": os.environ.get("REL_HOLD_FILE", ""),
                "tag": os.environ.get("REL_TAG", ""),
            },
        }
    },
}
# The relay's warnings (an outcome recorded late, LISTEN back) go to its output, which the test
# reads.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler", "level": "WARNING"}},
    "loggers": {"django_idempotency": {"handlers": ["stderr"], "level": "WARNING"}},
}
