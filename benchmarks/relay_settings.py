"""Settings for the relays of the deployed-relay benchmark (relay_deployed.py): the tests'
settings with the library's defaults for the outbox, and the publisher ``RELAY_BENCH_PUBLISHER``
names (memory, redis or latency)."""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENCY

_PUBLISHERS = {
    "memory": "benchmarks.relay_publishers.MemoryLogPublisher",
    "redis": "benchmarks.relay_publishers.RedisPushPublisher",
    "latency": "benchmarks.relay_publishers.LatencyPublisher",
}

IDEMPOTENCY = {
    **IDEMPOTENCY,
    "OUTBOX_PUBLISHERS": {"*": _PUBLISHERS[os.environ.get("RELAY_BENCH_PUBLISHER", "memory")]},
}

# The tests' middleware warning says nothing about a relay.
SILENCED_SYSTEM_CHECKS = ["django_idempotency.W007"]
