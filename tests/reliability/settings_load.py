"""The test project as the load and fault tests serve it with gunicorn.

Persistent database connections, as a production deployment has them: a database restart then
breaks connections a worker already holds, the harder case for recovery. With
``RELIABILITY_REDIS_URL`` set, the Redis copy runs in front of the database. Server errors
go to stderr, so a failing test shows the traceback the client never sees.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, IDEMPOTENCY
from tests.settings import LOGGING as BASE_LOGGING

DATABASES["default"]["CONN_MAX_AGE"] = 60

if os.environ.get("RELIABILITY_REDIS_URL"):
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "idempotency": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": os.environ["RELIABILITY_REDIS_URL"],
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.25, "SOCKET_TIMEOUT": 0.25},
        },
    }
    # A one-second rest after each Redis error (the default is 5), so that the Redis copy is
    # back in use within the few seconds of load the test leaves after Redis returns.
    IDEMPOTENCY = {**IDEMPOTENCY, "CACHE_ALIAS": "idempotency", "CACHE_RETRY_SECONDS": 1}


class NotUnavailable(logging.Filter):
    """503s are expected while the database is down; every other server error is shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "status_code", None) != 503


_base: dict[str, Any] = BASE_LOGGING
LOGGING = {
    **_base,
    "filters": {"not_503": {"()": NotUnavailable}},
    "handlers": {
        **_base["handlers"],
        "stderr": {"class": "logging.StreamHandler", "level": "ERROR", "filters": ["not_503"]},
    },
    "loggers": {
        **_base["loggers"],
        "django.request": {"handlers": ["stderr"], "level": "ERROR", "propagate": False},
    },
}
