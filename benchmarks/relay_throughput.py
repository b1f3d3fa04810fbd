"""Relay throughput on PostgreSQL: events per second, in-memory, AMQP and NATS JetStream.

    make bench-relay-brokers    # needs POSTGRES_URL; AMQP_URL for the AMQP rows; NATS_URL
                                # (default nats://127.0.0.1:4222, skipped if down) for JetStream

Creates a throwaway test database, fills the outbox with ``--events`` committed events, and
times ``Relay(batch_size=...).drain()`` until every event is PUBLISHED, for each publisher and
batch size. The AMQP publisher uses publisher confirms (one wait per batch) against a fresh
exchange with one bound queue, deleted afterwards. The Celery publisher sends tasks through
``benchmarks/celery_app.py`` (the same broker, publisher confirms on) into a fresh queue. The
NATS publisher awaits each batch's stream acks together, into a fresh file-stored stream,
deleted afterwards. Only the relay is timed, not the inserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("TEST_DATABASE", "postgresql")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import override_settings  # noqa: E402

from django_idempotency.models import OutboxEvent  # noqa: E402
from django_idempotency.outbox import publish  # noqa: E402
from django_idempotency.outbox.relay import Relay  # noqa: E402
from django_idempotency.publishers.memory import broker  # noqa: E402


def fill(count: int, keys: int) -> None:
    OutboxEvent.objects.all().delete()
    for start in range(0, count, 1000):
        with transaction.atomic():
            for n in range(start, min(start + 1000, count)):
                key = f"aggregate-{n % keys}" if keys else None
                publish("orders.paid", {"order": n, "total": "19.99"}, key=key)


def measure(routes: dict, batch_size: int, count: int, keys: int) -> float:
    fill(count, keys)
    broker.clear()
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_PUBLISHERS": routes}):
        started = time.perf_counter()
        with Relay(batch_size=batch_size) as relay:
            stats = relay.drain()
        elapsed = time.perf_counter() - started
    if stats.published != count:
        raise SystemExit(f"published {stats.published} of {count}: {stats}")
    return count / elapsed


def nats_reachable(url: str) -> bool:
    host, _, port = url.split("://", 1)[-1].rsplit("@", 1)[-1].partition(":")
    try:
        with socket.create_connection((host, int(port or 4222)), timeout=2):
            return True
    except OSError:
        return False


def nats_stream(url: str, name: str, subjects: list[str], *, delete: bool = False) -> None:
    """Create (or delete) the benchmark's stream."""
    import nats

    async def act() -> None:
        client = await nats.connect(url)
        try:
            jetstream = client.jetstream()
            if delete:
                await jetstream.delete_stream(name)
            else:
                await jetstream.add_stream(
                    name=name, subjects=subjects, storage="file", duplicate_window=600
                )
        finally:
            await client.close()

    asyncio.run(act())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--batch-sizes", default="10,50,100,500")
    parser.add_argument(
        "--keys", type=int, default=0, help="ordering keys to spread events over (0: none)"
    )
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        raise SystemExit("Run with TEST_DATABASE=postgresql and POSTGRES_URL set.")
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    old_name = connection.creation.create_test_db(verbosity=0, keepdb=False)
    amqp_url = os.environ.get("AMQP_URL")
    exchange_name = f"bench-outbox-{uuid.uuid4().hex}"
    publishers = {"memory": {"*": "django_idempotency.publishers.memory.MemoryPublisher"}}
    cleanup = None
    if amqp_url:
        from kombu import Connection, Exchange, Queue

        exchange = Exchange(exchange_name, type="topic", durable=True)
        queue = Queue(exchange_name, exchange=exchange, routing_key="#", durable=False)
        amqp = Connection(amqp_url)
        queue(amqp.default_channel).declare()
        publishers["amqp (confirms)"] = {
            "*": {
                "BACKEND": "django_idempotency.publishers.amqp.AMQPPublisher",
                "OPTIONS": {"url": amqp_url, "exchange": exchange_name},
            }
        }

        celery_queue = Queue(f"{exchange_name}-celery", durable=False)
        publishers["celery (confirms)"] = {
            "*": {
                "BACKEND": "django_idempotency.publishers.celery.CeleryPublisher",
                "OPTIONS": {
                    "app": "benchmarks.celery_app.app",
                    "task": "bench.noop",
                    "queue": celery_queue.name,
                },
            }
        }

        def cleanup() -> None:
            channel = amqp.default_channel
            queue(channel).delete()
            exchange(channel).delete()
            celery_queue(channel).delete()
            amqp.close()

    nats_url = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
    stream_name = f"BENCH_OUTBOX_{uuid.uuid4().hex[:12].upper()}"
    if nats_reachable(nats_url):
        prefix = stream_name.lower()
        nats_stream(nats_url, stream_name, [f"{prefix}.>"])
        publishers["nats jetstream"] = {
            "*": {
                "BACKEND": "django_idempotency.publishers.nats.NATSPublisher",
                "OPTIONS": {
                    "servers": nats_url,
                    "subject": f"{prefix}.{{topic}}",
                    "stream": stream_name,
                    "duplicate_window": 600,
                },
            }
        }
    try:
        print(f"PostgreSQL relay throughput, {args.events} events, keys={args.keys}")
        print(f"{'publisher':<16} {'batch':>6} {'events/s':>10}")
        for name, routes in publishers.items():
            for batch_size in batch_sizes:
                rate = measure(routes, batch_size, args.events, args.keys)
                print(f"{name:<16} {batch_size:>6} {rate:>10.0f}", flush=True)
                if cleanup is not None and name.startswith("amqp"):
                    queue(amqp.default_channel).purge()
                if cleanup is not None and name.startswith("celery"):
                    celery_queue(amqp.default_channel).purge()
    finally:
        if cleanup is not None:
            cleanup()
        if "nats jetstream" in publishers:
            nats_stream(nats_url, stream_name, [], delete=True)
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
