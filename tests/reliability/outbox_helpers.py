"""What the outbox and Celery fault tests share: relay and worker processes, business load, and
reading back what reached the broker."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import connections, transaction
from kombu import Connection, Exchange, Queue

from django_idempotency.outbox import publish
from tests.reliability.processes import Child
from tests.support.outbox_support import database_env
from tests.testapp.models import Widget

_STATS_LINE = re.compile(
    r"(\d+) claimed, (\d+) published, (\d+) failed, (\d+) dead, (\d+) released, (\d+) lost"
)
STAT_NAMES = ("claimed", "published", "failed", "dead", "released", "lost")


class RelayProcess(Child):
    """``manage.py outbox_relay --loop`` publishing to the private node."""

    def __init__(
        self, amqp_url: str, exchange: str, *, lease_seconds: float, name: str, **extra: str
    ) -> None:
        env = {
            **database_env(),
            "DJANGO_SETTINGS_MODULE": "tests.reliability.outbox_settings",
            "REL_AMQP_URL": amqp_url,
            "REL_EXCHANGE": exchange,
            "REL_LEASE_SECONDS": str(lease_seconds),
            **extra,
        }
        args = [sys.executable, "-m", "django", "outbox_relay", "--loop", "--sleep", "0.5"]
        super().__init__(args, env, name)

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while "Relaying outbox events" not in self.output():
            assert self.alive(), self.tail()
            assert time.monotonic() < deadline, f"relay did not start\n{self.tail()}"
            time.sleep(0.1)

    def stats(self) -> dict[str, int]:
        """The sum of the per-pass lines the command prints."""
        totals = dict.fromkeys(STAT_NAMES, 0)
        for match in _STATS_LINE.finditer(self.output()):
            for name, value in zip(STAT_NAMES, match.groups(), strict=True):
                totals[name] += int(value)
        return totals


class WorkerProcess(Child):
    """A Celery worker of ``tests.reliability.outbox_celery`` on the private node."""

    def __init__(
        self, amqp_url: str, queue: str, work_dir: Path, *, pool: str = "solo", name: str
    ) -> None:
        env = {
            **database_env(),
            "REL_AMQP_URL": amqp_url,
            "REL_CELERY_QUEUE": queue,
            "REL_WORK_DIR": str(work_dir),
        }
        args = [
            sys.executable, "-m", "celery", "-A", "tests.reliability.outbox_celery", "worker",
            f"--pool={pool}", "--concurrency=1", "-Q", queue, "--loglevel=WARNING",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
            # A name of its own: its control queue must not clash with any other worker's.
            f"--hostname={name}-{uuid.uuid4().hex[:8]}@%h",
        ]  # fmt: skip
        super().__init__(args, env, name)

    def pool_children(self) -> list[int]:
        """The prefork pool's processes (children of the main worker process)."""
        result = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.pid)], capture_output=True, text=True
        )
        return [int(pid) for pid in result.stdout.split()]


def consumers(amqp_url: str, queue: str) -> int:
    with Connection(amqp_url) as connection:
        declared = connection.default_channel.queue_declare(queue=queue, passive=True)
        return int(declared.consumer_count)


def queue_depth(amqp_url: str, queue: str) -> int:
    """Messages ready in ``queue`` (not those delivered and awaiting their ack)."""
    with Connection(amqp_url) as connection:
        declared = connection.default_channel.queue_declare(queue=queue, passive=True)
        return int(declared.message_count)


# --- the broker side ---------------------------------------------------------------------------


def declare_sink(amqp_url: str, exchange: str, queue: str) -> None:
    """A durable topic exchange and a durable queue bound to every topic: what a real
    subscriber has, so confirmed messages survive the broker's restarts."""
    bound = Queue(
        queue,
        exchange=Exchange(exchange, type="topic", durable=True),
        routing_key="#",
        durable=True,
    )
    with Connection(amqp_url) as connection:
        bound(connection.default_channel).declare()


def consume_all(amqp_url: str, queue: str, *, idle_seconds: float = 2.0) -> list[Delivery]:
    """Every message in ``queue``, in delivery order; stops once the queue stayed empty for
    ``idle_seconds``."""
    got: list[Delivery] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(Delivery(str(message.properties.get("message_id")), body))
        message.ack()

    with Connection(amqp_url) as connection:
        consumer = connection.Consumer(
            Queue(queue, durable=True, no_declare=True),
            callbacks=[on_message],
            accept=["json"],
            prefetch_count=500,
        )
        with consumer:
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < idle_seconds:
                before = len(got)
                with suppress(socket.timeout, TimeoutError):
                    connection.drain_events(timeout=0.5)
                if len(got) != before:
                    idle_since = time.monotonic()
    return got


@dataclass(frozen=True, slots=True)
class Delivery:
    message_id: str
    body: Any


def duplicates(deliveries: list[Delivery]) -> int:
    """Deliveries beyond the first of each message id."""
    return sum(count - 1 for count in Counter(d.message_id for d in deliveries).values())


# --- business load -----------------------------------------------------------------------------


class _Rollback(Exception):
    """Raised inside a business transaction to roll it back, events and all."""


@dataclass
class Load:
    """Threads committing business transactions that publish events; some roll back.

    Each thread writes one Widget and one to three events per transaction: the first keyed
    by the thread (so its keyed events have an order to keep: ``seq`` counts up), the others
    without a key. About one transaction in eight rolls back after publishing.
    """

    threads: int = 4
    pause: float = 0.005
    topic: str = "rel.orders"
    committed: dict[str, dict[str, Any]] = field(default_factory=dict)
    rolled_back: set[str] = field(default_factory=set)
    transactions: int = 0
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.threads):
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            thread.start()
            self._workers.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._workers:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self._workers), "load did not stop"

    def _run(self, index: int) -> None:
        rng = random.Random(index)
        key = f"t{index}-{uuid.uuid4().hex[:6]}"
        seq = 0
        try:
            while not self._stop.is_set():
                seq += 1
                events: list[tuple[str, dict[str, Any]]] = []
                rollback = rng.random() < 0.125
                try:
                    with transaction.atomic():
                        Widget.objects.create(name=f"{key}-{seq}")
                        for n in range(rng.randint(1, 3)):
                            event_key = key if n == 0 else ""
                            payload = {"key": event_key, "seq": seq, "n": n}
                            event = publish(self.topic, payload, key=event_key or None)
                            events.append((str(event.event_id), payload))
                        if rollback:
                            raise _Rollback
                except _Rollback:
                    pass
                with self._lock:
                    self.transactions += 1
                    if rollback:
                        self.rolled_back.update(event_id for event_id, _ in events)
                    else:
                        self.committed.update(events)
                time.sleep(self.pause)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            connections.close_all()


def wait_until(
    condition: Callable[[], Any], *, timeout: float, what: str, every: float = 0.2
) -> float:
    """Poll until ``condition()`` is truthy; returns the seconds it took."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - began


def figures(title: str, **values: Any) -> None:
    """Print the figures a test measured (shown with ``-s``, and in the captured output)."""
    shown = ", ".join(
        f"{name}={value:.2f}" if isinstance(value, float) else f"{name}={value}"
        for name, value in values.items()
    )
    print(f"\n[figures] {title}: {shown}")
