"""A relay fleet: events/s for 1, 2 and 4 relays, each a process of its own, draining one outbox.

    make bench-relay-brokers   # runs this after relay_throughput.py
    python benchmarks/relay_fleet.py --events 10000 --keys 100 --relays 1,2,4

Fills the outbox with ``--events`` committed events spread over ``--keys`` ordering keys, starts
the relays (default settings: batch size, lease and all), lets them go together and times until
every event is published. Each relay publishes in memory and notes, per message, the machine's
monotonic clock (one clock for every process on the machine). The run then checks what the
relays sent: every event at least once, how many twice, and, per key, that no event went out
before an earlier one of its key. It prints each relay's share and the CPU the relays and the
database's backends used, so a run that is bound by the machine's cores says so.

Then, at low load, commit -> publish latency: the relays run as ``outbox_relay --loop`` does
(``run_forever``: on PostgreSQL they LISTEN and a commit's NOTIFY wakes them), and events are
committed one at a time, ``--spacing`` seconds apart; each event's latency runs from just after
its commit returned to its publish, both on the machine's monotonic clock.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("TEST_DATABASE", "postgresql")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import override_settings  # noqa: E402

from benchmarks.relay_checks import database_cpu_seconds, first_sends, reordered  # noqa: E402
from benchmarks.relay_throughput import fill  # noqa: E402
from django_idempotency.conf import conf  # noqa: E402
from django_idempotency.db.querysets import OutboxStatus  # noqa: E402
from django_idempotency.exceptions import PublishError  # noqa: E402
from django_idempotency.models import OutboxEvent  # noqa: E402
from django_idempotency.outbox import publish  # noqa: E402
from django_idempotency.outbox.relay import Relay  # noqa: E402
from django_idempotency.outbox.report import RelayStats  # noqa: E402
from django_idempotency.publishers.amqp import AMQPPublisher  # noqa: E402
from django_idempotency.publishers.base import OutboxMessage, Publisher  # noqa: E402
from django_idempotency.publishers.celery import CeleryPublisher  # noqa: E402
from django_idempotency.publishers.memory import MemoryPublisher  # noqa: E402

#: (monotonic ns, event id) for every message this process published.
SENT: list[tuple[int, str]] = []


class TimedPublisher(MemoryPublisher):
    """Publishes in memory and notes when, on the machine's monotonic clock. With
    ``FLEET_FAIL_ONE_IN`` = N in the environment, one event in N fails its first attempt (it is
    published on its retry, after the relay's backoff)."""

    fail_one_in = int(os.environ.get("FLEET_FAIL_ONE_IN", "0"))

    def publish(self, message: OutboxMessage) -> None:
        if (
            self.fail_one_in
            and message.attempt == 1
            and message.event_id.int % self.fail_one_in == 0
        ):
            raise PublishError(f"injected first-attempt failure for {message.event_id}")
        super().publish(message)
        SENT.append((time.monotonic_ns(), str(message.event_id)))


class _NotesWhatItSent(Publisher):
    """Notes when each event the broker accepted went (one time per batch: the confirms')."""

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results = super().publish_many(messages)
        at = time.monotonic_ns()
        accepted = zip(messages, results, strict=True)
        SENT.extend((at, str(message.event_id)) for message, error in accepted if error is None)
        return results


class TimedAMQPPublisher(_NotesWhatItSent, AMQPPublisher):
    """The AMQP publisher: the batch sent, then its confirms awaited together."""


class TimedCeleryPublisher(_NotesWhatItSent, CeleryPublisher):
    """The Celery publisher, ``confirm_publish`` on: each task waits for its confirm."""


def routes() -> dict[str, Any]:
    """The publisher ``FLEET_PUBLISHER`` names: memory (default), amqp or celery."""
    name = os.environ.get("FLEET_PUBLISHER", "memory")
    if name == "amqp":
        options = {"url": os.environ["AMQP_URL"], "exchange": os.environ["FLEET_DESTINATION"]}
        return {"*": {"BACKEND": "benchmarks.relay_fleet.TimedAMQPPublisher", "OPTIONS": options}}
    if name == "celery":
        options = {
            "app": "benchmarks.celery_app.app",
            "task": "bench.noop",
            "queue": os.environ["FLEET_DESTINATION"],
        }
        return {"*": {"BACKEND": "benchmarks.relay_fleet.TimedCeleryPublisher", "OPTIONS": options}}
    return {"*": "benchmarks.relay_fleet.TimedPublisher"}


@contextmanager
def destination(publisher: str) -> Iterator[dict[str, str]]:
    """A fresh exchange (AMQP) or queue (Celery) on ``AMQP_URL`` for one run, deleted after;
    the environment the relays need to publish there."""
    if publisher == "memory":
        yield {"FLEET_PUBLISHER": "memory"}
        return
    from kombu import Connection, Exchange, Queue

    name = f"bench-fleet-{uuid.uuid4().hex[:12]}"
    with Connection(os.environ["AMQP_URL"]) as amqp:
        channel = amqp.default_channel
        exchange = Exchange(name, type="topic", durable=True)
        queue = Queue(name, exchange=exchange, routing_key="#", durable=False)
        if publisher == "amqp":
            queue(channel).declare()
        try:
            yield {"FLEET_PUBLISHER": publisher, "FLEET_DESTINATION": name}
        finally:
            channel = amqp.default_channel
            queue(channel).delete()
            if publisher == "amqp":
                exchange(channel).delete()


def child(out: str, batch_size: int | None) -> None:
    """One relay: wait for the go, relay until nothing is left, write down what it sent."""
    stats = RelayStats()
    empty_passes = 0
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_PUBLISHERS": routes()}):
        relay = Relay(batch_size=batch_size, share_keys=True)
        connection.ensure_connection()
        # Seated before the go, and looking again at once after it: every relay then knows
        # how many there are from its first claim (the steady state, not the first second).
        relay._seating.look()
        print("READY", flush=True)
        sys.stdin.readline()
        relay._seating.next_look = 0.0
        started = time.monotonic_ns()
        cpu = time.process_time()
        while True:
            pass_stats = relay.run_once()
            stats.add(pass_stats)
            if pass_stats.claimed:
                continue
            empty_passes += 1
            if not OutboxEvent.objects.filter(status=OutboxStatus.PENDING).exists():
                break
            time.sleep(0.005)  # the others hold what is left; look again shortly
        finished = time.monotonic_ns()
        relay.close()
    # The relay built its publisher from the dotted path, so from the module, not __main__.
    from benchmarks.relay_fleet import SENT as sent

    Path(out).write_text(
        json.dumps(
            {
                "sent": sent,
                "stats": stats.as_dict(),
                "started": started,
                "finished": finished,
                "cpu": time.process_time() - cpu,
                "empty_passes": empty_passes,
            }
        )
    )


def listening_child(out: str) -> None:
    """One relay as ``outbox_relay --loop`` runs it, until told to stop; then what it sent."""
    import threading

    stop = threading.Event()
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_PUBLISHERS": routes()}):
        relay = Relay()
        print("READY", flush=True)

        def wait_for_stop() -> None:
            sys.stdin.readline()
            stop.set()

        threading.Thread(target=wait_for_stop, daemon=True).start()
        relay.run_forever(stop)
        relay.close()
    from benchmarks.relay_fleet import SENT as sent

    Path(out).write_text(json.dumps({"sent": sent}))


def latency(relays: int, count: int, spacing: float) -> dict[str, float]:
    """Commit -> publish at low load: p50, p99 and max milliseconds over ``count`` events."""
    OutboxEvent.objects.all().delete()
    env = {**os.environ, "TEST_DATABASE_NAME": connection.settings_dict["NAME"]}
    committed: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        outs = [str(Path(folder) / f"relay-{n}.json") for n in range(relays)]
        children = [
            subprocess.Popen(
                [sys.executable, __file__, "--listening-child", out],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for out in outs
        ]
        for process in children:
            assert process.stdout is not None and process.stdout.readline().strip() == "READY"
        time.sleep(1.5)  # every relay seated, and listening
        for n in range(count):
            with transaction.atomic():
                event = publish("orders.paid", {"order": n}, key=f"aggregate-{n % 10}")
            committed[str(event.event_id)] = time.monotonic_ns()
            time.sleep(spacing)
        deadline = time.monotonic() + 60
        while OutboxEvent.objects.filter(status=OutboxStatus.PENDING).exists():
            if time.monotonic() > deadline:
                raise SystemExit("events still pending a minute after the last commit")
            time.sleep(0.05)
        for process in children:
            assert process.stdin is not None
            process.stdin.write("stop\n")
            process.stdin.flush()
        for process in children:
            process.wait(timeout=60)
        sent = [entry for out in outs for entry in json.loads(Path(out).read_text())["sent"]]
    first: dict[str, int] = {}
    for at, event_id in sorted(sent):
        first.setdefault(event_id, at)
    delays = sorted((first[event_id] - at) / 1e6 for event_id, at in committed.items())
    return {
        "p50": delays[len(delays) // 2],
        "p99": delays[min(len(delays) - 1, int(len(delays) * 0.99))],
        "max": delays[-1],
    }


def run(
    relays: int,
    count: int,
    keys: int,
    batch_size: int | None,
    *,
    fill_with: Callable[[int, int], None] = fill,
    env_extra: dict[str, str] | None = None,
    alongside: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> dict[str, Any]:
    """Fill the outbox, let ``relays`` relay processes drain it (``alongside`` open while they
    do), and check what they sent."""
    fill_with(count, keys)
    ids = dict(OutboxEvent.objects.values_list("event_id", "pk"))
    key_of = dict(OutboxEvent.objects.values_list("pk", "key"))
    env = {
        **os.environ,
        **(env_extra or {}),
        "TEST_DATABASE_NAME": connection.settings_dict["NAME"],
    }
    with tempfile.TemporaryDirectory() as folder:
        outs = [str(Path(folder) / f"relay-{n}.json") for n in range(relays)]
        children = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", out]
                + (["--batch-size", str(batch_size)] if batch_size else []),
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for out in outs
        ]
        for process in children:
            assert process.stdout is not None and process.stdout.readline().strip() == "READY"
        database_cpu = database_cpu_seconds()
        with alongside():
            started = time.monotonic_ns()
            for process in children:
                assert process.stdin is not None
                process.stdin.write("go\n")
                process.stdin.flush()
            for process in children:
                if process.wait(timeout=3600) != 0:
                    raise SystemExit(f"a relay exited with {process.returncode}")
            elapsed = (time.monotonic_ns() - started) / 1e9
        database_cpu = database_cpu_seconds() - database_cpu
        results = [json.loads(Path(out).read_text()) for out in outs]
    sent = sorted(
        (at, ids[uuid_text(event_id)]) for result in results for at, event_id in result["sent"]
    )
    first_seen = first_sends(sent)
    return {
        "relays": relays,
        "events_per_second": count / elapsed,
        "shares": [len(result["sent"]) for result in results],
        "empty_passes": sum(result["empty_passes"] for result in results),
        "lost": count - len(first_seen),
        "duplicates": len(sent) - len(first_seen),
        "reordered": reordered(first_seen, key_of),
        "relay_cpu": sum(result["cpu"] for result in results),
        "database_cpu": database_cpu,
        "elapsed": elapsed,
    }


def uuid_text(value: str) -> Any:
    import uuid

    return uuid.UUID(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--relays", default="1,2,4")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the setting's")
    parser.add_argument(
        "--publishers",
        default="memory,amqp,celery",
        help="memory, amqp (confirms per batch), celery (confirm_publish); amqp and celery "
        "need AMQP_URL and are left out without it",
    )
    parser.add_argument("--latency-events", type=int, default=200)
    parser.add_argument("--spacing", type=float, default=0.05, help="seconds between commits")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--listening-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch_size)
        return
    if args.listening_child:
        listening_child(args.listening_child)
        return
    if connection.vendor != "postgresql":
        raise SystemExit("Run with TEST_DATABASE=postgresql and POSTGRES_URL set.")
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        batch = args.batch_size or conf.OUTBOX_BATCH_SIZE
        print(
            f"Relay fleet on PostgreSQL, {args.events} events over {args.keys} keys, batch {batch}"
        )
        print("| publisher | relays | events/s | share per relay | lost | twice | reordered "
              "| relay CPU s | PostgreSQL CPU s | wall s | passes finding nothing |")  # fmt: skip
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        publishers = [
            name
            for name in args.publishers.split(",")
            if name == "memory" or os.environ.get("AMQP_URL")
        ]
        for publisher, relays in (
            (publisher, int(n)) for publisher in publishers for n in args.relays.split(",")
        ):
            with destination(publisher) as env_extra:
                row = run(relays, args.events, args.keys, args.batch_size, env_extra=env_extra)
            shares = " / ".join(f"{share:,}" for share in row["shares"])
            print(
                f"| {publisher} | {relays} | {row['events_per_second']:,.0f} | {shares} "
                f"| {row['lost']} "
                f"| {row['duplicates']} | {row['reordered']} | {row['relay_cpu']:.1f} "
                f"| {row['database_cpu']:.1f} | {row['elapsed']:.1f} | {row['empty_passes']} |",
                flush=True,
            )
        print(
            f"\nCommit -> publish at low load: {args.latency_events} events committed one at a "
            f"time, {args.spacing * 1000:.0f} ms apart, relays woken by NOTIFY"
        )
        print("| relays | p50 ms | p99 ms | max ms |")
        print("|---:|---:|---:|---:|")
        for relays in (1, 2):
            row = latency(relays, args.latency_events, args.spacing)
            print(
                f"| {relays} | {row['p50']:.1f} | {row['p99']:.1f} | {row['max']:.1f} |", flush=True
            )
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
