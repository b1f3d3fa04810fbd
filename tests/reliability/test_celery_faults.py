"""Celery consumers under faults: a worker killed mid-task, and duplicate deliveries.

Real worker processes consume from a private RabbitMQ node, with tasks that are idempotent
consumers (the inbox) and write one Widget per effect. Messages are sent by the outbox's own
``CeleryPublisher``, as the relay sends them: the task id and the ``event_id`` header are the
event id.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_idempotency.models import ProcessedMessage
from django_idempotency.publishers.base import OutboxMessage
from django_idempotency.publishers.celery import CeleryPublisher
from tests.reliability.broker import RabbitNode
from tests.reliability.outbox_helpers import (
    WorkerProcess,
    consumers,
    figures,
    queue_depth,
    wait_until,
)
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def rabbit() -> Iterator[RabbitNode]:
    with RabbitNode.running() as node:
        yield node


@pytest.fixture
def queue() -> str:
    return f"rel-celery-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def send(rabbit: RabbitNode, queue: str) -> Iterator[Any]:
    """``send(task, payload, event_id=None)``: one message, as the relay would send it."""
    from tests.reliability.outbox_celery import make_app

    app = make_app(rabbit.url, queue)
    publishers: dict[str, CeleryPublisher] = {}

    def send(task: str, payload: dict[str, Any], event_id: uuid.UUID | None = None) -> uuid.UUID:
        publisher = publishers.setdefault(task, CeleryPublisher(app=app, task=task, queue=queue))
        message = OutboxMessage(
            event_id=event_id or uuid.uuid4(), topic="rel.celery", key="", payload=payload
        )
        publisher.publish(message)
        return message.event_id

    yield send
    app.close()


def _consumers(rabbit: RabbitNode, queue: str) -> int:
    try:
        return consumers(rabbit.url, queue)
    except Exception:  # not declared yet: the worker declares it when it starts consuming
        return 0


def _runs(work: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(work.glob("run-*.json"))]


def _delivery_log(work: Path) -> list[tuple[str, str, float, str, bool]]:
    """``(event, task id, time, worker log, redelivered)`` for every delivery start and end;
    ``redelivered``: the broker had delivered the message before."""
    rows = []
    for path in work.glob("deliveries-*.log"):
        for line in path.read_text().splitlines():
            event, task_id, at, again = line.split()
            rows.append((event, task_id, float(at), path.name, again == "1"))
    return rows


def _deliveries(work: Path, *, redelivered: bool | None = None) -> Counter[str]:
    """Deliveries per task id: all of them, or only the broker's redeliveries (``True``) or
    only first deliveries (``False``)."""
    return Counter(
        task_id
        for event, task_id, _, _, again in _delivery_log(work)
        if event == "start" and redelivered in (None, again)
    )


def _overlapping_copies(work: Path) -> int:
    """Deliveries that ran while another delivery of the same message ran in another worker."""
    spans: dict[tuple[str, str], list[float]] = {}
    for event, task_id, at, worker, _ in sorted(_delivery_log(work), key=lambda row: row[2]):
        if event == "start":
            spans.setdefault((task_id, worker), []).append(at)
        else:
            spans[(task_id, worker)].append(at)
    runs = [(task_id, worker, times) for (task_id, worker), times in spans.items()]
    overlapping = 0
    for task_id, worker, times in runs:
        mine = list(zip(times[::2], times[1::2], strict=False))
        theirs = [
            span
            for other_id, other, other_times in runs
            if other_id == task_id and other != worker
            for span in zip(other_times[::2], other_times[1::2], strict=False)
        ]
        overlapping += sum(
            1 for start, end in mine if any(s < end and start < e for s, e in theirs)
        )
    return overlapping


@pytest.mark.parametrize(
    ("pool", "stage"),
    [("solo", "before_commit"), ("solo", "after_commit"), ("prefork", "before_commit")],
)
def test_worker_killed_mid_task_gets_the_message_again_and_the_effect_happens_once(
    rabbit: RabbitNode, queue: str, send: Any, tmp_path: Path, pool: str, stage: str
) -> None:
    """``solo``: the whole worker is SIGKILLed, the broker requeues its unacknowledged message
    and a new worker gets it. ``prefork``: only the pool process running the task is
    SIGKILLed; with ``acks_late`` and ``reject_on_worker_lost`` the same worker gets the message
    again in a new pool process. ``before_commit``: killed inside the handler's transaction
    (the effect rolls back and runs again); ``after_commit``: killed after the commit, before
    the acknowledgement (the redelivery is skipped as a duplicate)."""
    task = f"rel.hold_{stage}"
    (tmp_path / "hold").touch()
    workers: list[WorkerProcess] = []
    try:
        workers.append(WorkerProcess(rabbit.url, queue, tmp_path, pool=pool, name="doomed"))
        wait_until(lambda: _consumers(rabbit, queue) >= 1, timeout=60, what="the worker")
        name = f"held-{uuid.uuid4().hex[:8]}"
        event_id = send(task, {"name": name})
        wait_until(lambda: _runs(tmp_path), timeout=60, what="the task to start")
        committed_before_kill = Widget.objects.filter(name=name).count()
        assert committed_before_kill == (1 if stage == "after_commit" else 0)

        if pool == "prefork":
            (child,) = workers[0].pool_children()
            os.kill(child, signal.SIGKILL)
        else:
            workers[0].kill()
        killed_at = time.monotonic()
        (tmp_path / "hold").unlink()
        if pool == "solo":
            workers.append(WorkerProcess(rabbit.url, queue, tmp_path, pool=pool, name="next"))

        wait_until(lambda: len(_runs(tmp_path)) == 2, timeout=60, what="the redelivery")
        redelivered_after = time.monotonic() - killed_at
        # A message queued behind it is done once the worker acknowledged the held one.
        sentinel = f"sentinel-{uuid.uuid4().hex[:8]}"
        send("rel.record", {"name": sentinel})
        wait_until(lambda: Widget.objects.filter(name=sentinel).exists(), timeout=60, what="it")
        for worker in workers[1:] if pool == "solo" else workers:
            assert worker.alive(), worker.tail()
    except BaseException:
        for worker in workers:
            print(worker.tail())
        raise
    finally:
        for worker in workers:
            worker.terminate()
            worker.close()

    first, second = _runs(tmp_path)
    assert not first["redelivered"] and second["redelivered"]
    assert second["duplicate"] is (stage == "after_commit")
    if pool == "prefork":
        assert first["pid"] != second["pid"]  # a new pool process of the same worker
    assert _deliveries(tmp_path)[str(event_id)] == 2
    assert Widget.objects.filter(name=name).count() == 1
    assert ProcessedMessage.objects.filter(consumer=task, message_id=str(event_id)).count() == 1
    assert queue_depth(rabbit.url, queue) == 0
    figures(
        f"worker killed ({pool}, {stage})",
        deliveries=2,
        effects=1,
        redelivered_s_after_kill=redelivered_after,
    )


def test_duplicate_deliveries_of_one_message_id_have_one_effect(
    rabbit: RabbitNode, queue: str, send: Any, tmp_path: Path
) -> None:
    """Copies of each message back to back, to two workers: many copies run at the same time,
    the second waiting on the first's uncommitted marker, and are skipped once it commits.
    Forty messages come three times each, one twenty times."""
    copies = {uuid.uuid4(): 3 for _ in range(40)}
    copies[uuid.uuid4()] = 20
    names = {event_id: f"dup-{event_id.hex[:12]}" for event_id in copies}
    workers: list[WorkerProcess] = []
    try:
        for n in range(2):
            # Prefork, not solo: a solo worker can sit on a finished task's acknowledgement
            # for its event loop's 10 s poll, which only slows the test down.
            worker = WorkerProcess(rabbit.url, queue, tmp_path, pool="prefork", name=f"dup{n}")
            workers.append(worker)
        wait_until(lambda: _consumers(rabbit, queue) >= 2, timeout=60, what="two workers")
        began = time.monotonic()
        for event_id, count in copies.items():
            for _ in range(count):
                send("rel.record", {"name": names[event_id], "linger": 0.02}, event_id=event_id)
        total = sum(copies.values())
        wait_until(
            lambda: sum(_deliveries(tmp_path, redelivered=False).values()) == total,
            timeout=120,
            what="every copy to be delivered",
        )
        # A warm shutdown lets the tasks under way finish and acknowledge.
        for worker in workers:
            assert worker.terminate() == 0, worker.tail()
        elapsed = time.monotonic() - began
    except BaseException:
        for worker in workers:
            print(worker.tail())
        for path in tmp_path.glob("deliveries-*"):
            print(path, path.read_text())
        raise
    finally:
        for worker in workers:
            worker.close()

    # Every copy was delivered. A worker's warm shutdown can lose the acknowledgement of a copy
    # it ran last, and the broker then delivers that copy again (flagged as redelivered) to the
    # other worker: one more delivery, and still no second effect.
    first = _deliveries(tmp_path, redelivered=False)
    assert {uuid.UUID(task_id): count for task_id, count in first.items()} == copies
    total += sum(_deliveries(tmp_path, redelivered=True).values())
    effects = Counter(Widget.objects.filter(name__startswith="dup-").values_list("name", flat=True))
    assert effects == Counter(names.values())  # each message's effect exactly once
    markers = ProcessedMessage.objects.filter(consumer="rel.record")
    assert set(markers.values_list("message_id", flat=True)) == set(map(str, copies))
    assert queue_depth(rabbit.url, queue) == 0
    figures(
        "duplicate deliveries",
        messages=len(copies),
        deliveries=total,
        effects=sum(effects.values()),
        duplicates_skipped=total - sum(effects.values()),
        copies_running_at_once=_overlapping_copies(tmp_path),
        seconds=elapsed,
    )
