"""The relay as operators deploy it: events/s for 1, 2 and 4 ``outbox_relay --loop`` processes,
against a SQL floor, with a choice of publisher.

    make bench-relay
    python benchmarks/relay_deployed.py --publishers redis --relays 1,2 --events 40000

Each relay is the management command in a process of its own, with the library's default
settings (batch, lease, poll). Publishers (benchmarks/relay_publishers.py): ``memory`` (no
broker), ``redis`` (one ``RPUSH`` per event, a broker taking one message per round trip) and
``latency`` (5 ms per batch, a broker with confirms awaited together).

Two shapes of work, both on ``--keys`` ordering keys:

* **backlog**: ``--events`` events committed before the relays start; timed from the first
  publish to the last, so the processes' start-up is left out.
* **burst**: the relays run and are idle; ``--burst`` events commit in one transaction; timed
  from that commit to the last publish.

The **SQL floor** is the least a relay could do with the same publisher: one statement claims a
batch (``FOR UPDATE SKIP LOCKED``, no per-key order, no fencing, no seats), the publisher sends
it, one statement acknowledges it; run by as many processes as the relays. Ours is reported as a
ratio to it.

With ``--fail-one-in N`` one event in N fails its first attempt; the floor is then the retries'
(``retry_floor``): per-key order holds a key for each of its failures' backoffs, so no relay can
drain faster than the key that waits longest allows.

Every run is checked from what the publishers noted (one monotonic clock for every process on
the machine): every event published, how many twice, and per key, whether an event went out
before an earlier one of its key. Results go to ``benchmarks/results/relay.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.relay_settings")
os.environ.setdefault("TEST_DATABASE", "postgresql")

import django  # noqa: E402

django.setup()

from django.db import connection, transaction  # noqa: E402

from benchmarks.relay_checks import database_cpu_seconds, first_sends, reordered  # noqa: E402
from benchmarks.relay_throughput import fill  # noqa: E402
from django_idempotency.conf import conf  # noqa: E402
from django_idempotency.db import session_locks  # noqa: E402
from django_idempotency.models import OutboxEvent  # noqa: E402
from django_idempotency.outbox.publish import NOTIFY_CHANNEL  # noqa: E402

TABLE = OutboxEvent._meta.db_table
STAGING = "bench_relay_staging"
RESULTS = ROOT / "benchmarks" / "results" / "relay.json"


# --- the outbox ---------------------------------------------------------------------------------


def stage(count: int, keys: int) -> None:
    """``count`` events on ``keys`` keys, interleaved, kept in a table of their own to load each
    run: the first 1,000 committed through ``publish()``, the rest copies of them with ids, keys
    and payloads of their own (a million events through ``publish()`` would take minutes)."""
    fill(min(count, 1000), keys)
    with connection.cursor() as cursor:
        if count > 1000:
            columns = [
                field.column
                for field in OutboxEvent._meta.concrete_fields
                if field.column not in ("id", "event_id", "key", "payload")
            ]
            listed = ", ".join(columns)
            cursor.execute(
                f"INSERT INTO {TABLE} (event_id, key, payload, {listed}) "
                f"SELECT gen_random_uuid(), 'aggregate-' || (n %% %s), "
                f"jsonb_build_object('order', n, 'total', '19.99'), {listed} "
                f"FROM generate_series(1000, %s) AS n, "
                f"(SELECT {listed} FROM {TABLE} ORDER BY id LIMIT 1) AS template",
                [keys, count - 1],
            )
        cursor.execute(f"DROP TABLE IF EXISTS {STAGING}")
        cursor.execute(f"CREATE TABLE {STAGING} AS SELECT * FROM {TABLE} ORDER BY id")
        cursor.execute(f"TRUNCATE {TABLE}")


def load(count: int) -> None:
    """An empty outbox, then the first ``count`` staged events in one transaction, which wakes
    listening relays as a publishing commit does."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {TABLE}")
        cursor.execute(
            f"INSERT INTO {TABLE} SELECT * FROM {STAGING} WHERE id IN "
            f"(SELECT id FROM {STAGING} ORDER BY id LIMIT %s)",
            [count],
        )
        cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])


def pending() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {TABLE} WHERE status = 'PENDING')")
        return bool(cursor.fetchone()[0])


def staged(count: int) -> tuple[dict[str, int], dict[int, str]]:
    """The staged events' ids by event id (hex), and their keys by id."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, event_id, key FROM {STAGING} ORDER BY id LIMIT %s", [count])
        rows = cursor.fetchall()
    return {uuid.UUID(str(event_id)).hex: pk for pk, event_id, _ in rows}, {
        pk: key for pk, _, key in rows
    }


def retry_floor(count: int, fail_one_in: int) -> float:
    """With one event in ``fail_one_in`` failing once, the most events/s per-key order allows
    on average, however fast the relay: each failure holds its key for its backoff (uniform over
    ``[0, OUTBOX_BACKOFF_BASE_SECONDS]``, half of it on average), so the drain lasts at least as
    long as the key with the most failures waits."""
    ids, keys = staged(count)
    failures: dict[str, int] = {}
    for event_id, pk in ids.items():
        if int(event_id, 16) % fail_one_in == 0:
            failures[keys[pk]] = failures.get(keys[pk], 0) + 1
    longest = max(failures.values(), default=0) * conf.OUTBOX_BACKOFF_BASE_SECONDS / 2
    return count / longest if longest else float("inf")


# --- processes ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def processes(
    commands: list[list[str]], env: dict[str, str]
) -> Iterator[list[subprocess.Popen[str]]]:
    """Start the commands; on the way out, SIGTERM them and wait (killing what hangs)."""
    started = [
        subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for command in commands
    ]
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_until(condition: Any, timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(step)


# --- one run -----------------------------------------------------------------------------------


def run(kind: str, publisher: str, workers: int, count: int, shape: str) -> dict[str, Any]:
    """``workers`` relays (``kind`` "relay") or floor processes ("floor") drain ``count`` events
    of the given ``shape`` ("backlog" or "burst") through ``publisher``."""
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {TABLE}")
    if shape == "backlog":
        load(count)
    with tempfile.TemporaryDirectory() as folder:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "benchmarks.relay_settings",
            "TEST_DATABASE_NAME": connection.settings_dict["NAME"],
            "RELAY_BENCH_PUBLISHER": publisher,
            "RELAY_BENCH_LOG_DIR": folder,
            "RELAY_BENCH_REDIS_LIST": f"bench:relay:{uuid.uuid4().hex}",
            "PYTHONPATH": str(ROOT),
        }
        if kind == "relay":
            command = [sys.executable, "-m", "django", "outbox_relay", "--loop", "-v", "0"]
        else:
            command = [sys.executable, __file__, "--floor-child"]
        database_cpu = database_cpu_seconds()
        with processes([command] * workers, env) as started:
            if kind == "relay":
                # Every relay seated and listening before the burst commits.
                wait_until(lambda: session_locks.fleet("default") == workers, 60, "the seats")
                time.sleep(1.5)
            else:
                for process in started:
                    assert process.stdout is not None
                    if process.stdout.readline().strip() != "READY":
                        raise SystemExit("a floor process did not start")
            if shape == "burst":
                load(count)
            committed = time.monotonic_ns()
            if kind == "floor":
                for process in started:
                    assert process.stdin is not None
                    process.stdin.write("go\n")
                    process.stdin.flush()
            wait_until(lambda: not pending(), 3600, "the outbox to drain", step=0.25)
            cpu = sum(cpu_seconds(process.pid) for process in started)
        database_cpu = database_cpu_seconds() - database_cpu
        sent = sorted(
            (int(at), event_id)
            for log in Path(folder).glob("*.log")
            for at, event_id in (line.split() for line in log.read_text().splitlines())
        )
        shares = sorted(len(log.read_text().splitlines()) for log in Path(folder).glob("*.log"))
    ids, keys = staged(count)
    first = first_sends((at, ids[event_id]) for at, event_id in sent)
    start = sent[0][0] if shape == "backlog" else committed
    elapsed = (sent[-1][0] - start) / 1e9
    return {
        "kind": kind,
        "publisher": publisher,
        "processes": workers,
        "shape": shape,
        "events": count,
        "events_per_second": round(count / elapsed),
        "seconds": round(elapsed, 2),
        "shares": shares,
        "lost": count - len(first),
        "twice": len(sent) - len(first),
        "reordered": reordered(first, keys),
        "process_cpu_seconds": round(cpu, 2),
        "postgresql_cpu_seconds": round(database_cpu, 2),
    }


# --- the SQL floor -----------------------------------------------------------------------------

FLOOR_CLAIM = f"""
WITH batch AS (
    SELECT id FROM {TABLE}
    WHERE status = 'PENDING' AND (locked_until IS NULL OR locked_until < now())
    ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED
)
UPDATE {TABLE} AS event SET locked_until = now() + interval '15 seconds', relay_token = %s
FROM batch WHERE event.id = batch.id
RETURNING event.id, event.event_id, event.topic, event.key, event.payload, event.headers,
    event.created_at, event.attempts
"""
FLOOR_ACK = f"""
UPDATE {TABLE} SET status = 'PUBLISHED', published_at = now(), locked_until = NULL,
    relay_token = NULL
WHERE id = ANY(%s)
"""


def floor_child() -> None:
    """Claim a batch in one statement, publish it, acknowledge it in one, until none is left."""
    from django_idempotency.publishers.base import OutboxMessage
    from django_idempotency.publishers.routing import PublisherSet

    publisher = PublisherSet().for_topic("orders.paid")
    batch_size = conf.OUTBOX_BATCH_SIZE
    connection.ensure_connection()
    print("READY", flush=True)
    sys.stdin.readline()
    with connection.cursor() as cursor:
        while True:
            cursor.execute(FLOOR_CLAIM, [batch_size, uuid.uuid4()])
            rows = cursor.fetchall()
            if not rows:
                if not pending():
                    break
                time.sleep(0.001)
                continue
            messages = [
                OutboxMessage(
                    event_id=event_id if isinstance(event_id, uuid.UUID) else uuid.UUID(event_id),
                    topic=topic,
                    key=key,
                    payload=payload if not isinstance(payload, str) else json.loads(payload),
                    headers=headers if not isinstance(headers, str) else json.loads(headers),
                    created_at=created_at,
                    attempt=attempts + 1,
                )
                for _, event_id, topic, key, payload, headers, created_at, attempts in rows
            ]
            publisher.publish_many(messages)
            cursor.execute(FLOOR_ACK, [[row[0] for row in rows]])
    publisher.close()


# --- the report --------------------------------------------------------------------------------


def host() -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        server = cursor.fetchone()[0]
        cursor.execute("SHOW autovacuum")
        autovacuum = cursor.fetchone()[0]
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "postgresql": server,
        "autovacuum": autovacuum,
        "database_and_broker": "on the same host",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=40_000, help="the backlog's events")
    parser.add_argument("--burst", type=int, default=10_000, help="the burst's events")
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--relays", default="1,2,4")
    parser.add_argument("--publishers", default="memory,redis,latency")
    parser.add_argument("--shapes", default="backlog,burst")
    parser.add_argument("--no-floor", action="store_true", help="relays only")
    parser.add_argument(
        "--fail-one-in", type=int, default=0, help="one event in N fails its first attempt"
    )
    parser.add_argument("--out", default=str(RESULTS), help="where the JSON goes ('' for none)")
    parser.add_argument(
        "--table-options",
        default="",
        help="storage parameters for the outbox table, e.g. autovacuum_vacuum_scale_factor=0.01",
    )
    parser.add_argument("--floor-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_child:
        floor_child()
        return
    if connection.vendor != "postgresql":
        raise SystemExit("Run with TEST_DATABASE=postgresql and POSTGRES_URL set.")
    if args.fail_one_in:
        os.environ["RELAY_BENCH_FAIL_ONE_IN"] = str(args.fail_one_in)
        args.no_floor = True  # the floor has no retries: it would count the failures lost
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    machine = host()
    if args.table_options:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {TABLE} SET ({args.table_options})")
    rows: list[dict[str, Any]] = []
    try:
        stage(max(args.events, args.burst), args.keys)
        print(
            f"Relays as deployed (outbox_relay --loop, default settings, batch "
            f"{conf.OUTBOX_BATCH_SIZE}), PostgreSQL, {args.keys} keys"
        )
        print(
            "| publisher | shape | events | relays | relay events/s | floor events/s "
            "| × floor | × 1 relay | lost | twice | reordered | relay CPU s | PostgreSQL CPU s |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for publisher in args.publishers.split(","):
            floors: dict[int, dict[str, Any]] = {}
            for shape in args.shapes.split(","):
                count = args.events if shape == "backlog" else args.burst
                one: float | None = None
                for workers in (int(n) for n in args.relays.split(",")):
                    row = run("relay", publisher, workers, count, shape)
                    if not args.no_floor and shape == "backlog":
                        floors[workers] = run("floor", publisher, workers, count, "backlog")
                        rows.append(floors[workers])
                    floor = floors.get(workers)
                    one = one or row["events_per_second"]
                    row["x_floor"] = (
                        round(row["events_per_second"] / floor["events_per_second"], 2)
                        if floor
                        else None
                    )
                    row["x_one_relay"] = round(row["events_per_second"] / one, 2)
                    if args.fail_one_in:  # the floor is the retries' (see retry_floor)
                        floor = {"events_per_second": round(retry_floor(count, args.fail_one_in))}
                        row["x_floor"] = round(
                            row["events_per_second"] / floor["events_per_second"], 2
                        )
                        row["retry_floor"] = floor["events_per_second"]
                    floor_text = f"{floor['events_per_second']:,}" if floor else "-"
                    rows.append(row)
                    print(
                        f"| {publisher} | {shape} | {count:,} | {workers} "
                        f"| {row['events_per_second']:,} "
                        f"| {floor_text} "
                        f"| {row['x_floor'] or '-'} | {row['x_one_relay']} | {row['lost']} "
                        f"| {row['twice']} | {row['reordered']} | {row['process_cpu_seconds']} "
                        f"| {row['postgresql_cpu_seconds']} |",
                        flush=True,
                    )
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)
    # The floor keeps no per-key order: only what it lost or sent twice counts against it.
    bad = [
        row
        for row in rows
        if row["lost"] or row["twice"] or (row["kind"] == "relay" and row["reordered"])
    ]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "host": machine,
                    "keys": args.keys,
                    "fail_one_in": args.fail_one_in,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"\nWritten to {args.out}")
    if bad:
        raise SystemExit(f"{len(bad)} runs lost, duplicated or reordered events: {bad}")


if __name__ == "__main__":
    main()
