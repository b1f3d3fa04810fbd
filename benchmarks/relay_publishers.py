"""The publishers of the deployed-relay benchmark (relay_deployed.py), importable by a relay
process that builds them from ``OUTBOX_PUBLISHERS``.

Each notes, per event, the machine's monotonic clock (one clock for every process) in a file of
its process's own under ``RELAY_BENCH_LOG_DIR``, flushed after every batch, so the benchmark can
check what went out: every event, none twice, and per key in order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import IO, Any

from django_idempotency.exceptions import PublishError
from django_idempotency.publishers.base import OutboxMessage, Publisher

__all__ = ["LatencyPublisher", "MemoryLogPublisher", "RedisPushPublisher"]

#: Seconds a :class:`LatencyPublisher` batch takes: a broker whose confirms come back together.
BATCH_LATENCY_SECONDS = float(os.environ.get("RELAY_BENCH_BATCH_LATENCY", "0.005"))
#: With N here, one event in N fails its first attempt (published on its retry, after the
#: relay's backoff).
FAIL_ONE_IN = int(os.environ.get("RELAY_BENCH_FAIL_ONE_IN", "0"))


class MemoryLogPublisher(Publisher):
    """Accepts every message at once (no broker): the relay's own cost."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._log: IO[str] | None = None

    def publish(self, message: OutboxMessage) -> None:  # pragma: no cover - batches only
        self.publish_many([message])

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results: list[BaseException | None] = [
            PublishError(f"injected first-attempt failure for {message.event_id}")
            if FAIL_ONE_IN and message.attempt == 1 and message.event_id.int % FAIL_ONE_IN == 0
            else None
            for message in messages
        ]
        accepted = [m for m, error in zip(messages, results, strict=True) if error is None]
        self.send(accepted)
        self.note(accepted)
        return results

    def send(self, messages: Sequence[OutboxMessage]) -> None:
        """Hand the messages to the broker (nothing here)."""

    def note(self, messages: Sequence[OutboxMessage]) -> None:
        if self._log is None:
            folder = os.environ["RELAY_BENCH_LOG_DIR"]
            self._log = open(os.path.join(folder, f"{os.getpid()}.log"), "a")  # noqa: SIM115
        at = time.monotonic_ns()
        self._log.write("".join(f"{at} {message.event_id.hex}\n" for message in messages))
        self._log.flush()


class RedisPushPublisher(MemoryLogPublisher):
    """One Redis ``RPUSH`` per message, on a kept connection: a broker that takes one message
    per round trip."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        import redis

        self._redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
        self._list = os.environ.get("RELAY_BENCH_REDIS_LIST", "bench:relay")

    def send(self, messages: Sequence[OutboxMessage]) -> None:
        for message in messages:
            self._redis.rpush(self._list, message.event_id.bytes)

    def close(self) -> None:
        self._redis.close()
        super().close()


class LatencyPublisher(MemoryLogPublisher):
    """A fixed latency per batch (``RELAY_BENCH_BATCH_LATENCY``, 5 ms): a broker with
    publisher confirms awaited together."""

    def send(self, messages: Sequence[OutboxMessage]) -> None:
        time.sleep(BATCH_LATENCY_SECONDS)
