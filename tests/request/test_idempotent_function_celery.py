"""``@idempotent_function`` and ``@handed_off`` under Celery: stacked under ``@app.task``, and a
real worker killed mid-task whose message is redelivered to another worker.

The workers are real ``celery worker`` processes (``tests/support/function_celery.py``) on the
shared RabbitMQ, each test with a queue of its own, deleted afterwards; they are SIGKILLed as a
whole process group, so nothing of theirs runs after the kill.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from kombu import Connection, Queue

from django_idempotency.db.querysets import COMPLETED
from django_idempotency.models import IdempotencyRecord, OutboxEvent
from tests.reliability.outbox_helpers import Child, queue_depth, wait_until
from tests.support.outbox_support import database_env
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

ON_SQLITE = connection.vendor == "sqlite"
#: The function's lease in the workers. Where owners hold session locks (PostgreSQL, MariaDB) a
#: dead worker's key is taken over as soon as its connection is gone, long before this; on
#: SQLite the redelivery waits for the lease to run out, retrying.
LEASE_SECONDS = 3 if ON_SQLITE else 20


def test_stacked_under_a_task_it_keeps_the_signature_and_runs_once():
    from tests.support.function_celery import charge

    assert list(inspect.signature(charge.run).parameters) == ["order_id", "stage"]
    first = charge.apply(kwargs={"order_id": 1, "stage": "none"}, task_id=str(uuid.uuid4()))
    # Another message (another task id) for the same order: the key is the order.
    second = charge.apply(kwargs={"order_id": 1, "stage": "none"}, task_id=str(uuid.uuid4()))
    assert first.result == second.result == {"order_id": 1, "widget": first.result["widget"]}
    assert Widget.objects.filter(name="fn-order-1").count() == 1


@pytest.fixture
def queue(amqp_url: str) -> Iterator[str]:
    """A queue of this test's own on the shared broker, deleted afterwards."""
    name = f"di-fn-{uuid.uuid4().hex[:10]}"
    yield name
    with Connection(amqp_url) as broker:
        Queue(name, no_declare=True)(broker.default_channel).delete()


def start_worker(amqp_url: str, queue: str, work: Path, name: str) -> Child:
    env = {
        **database_env(),
        "FN_AMQP_URL": amqp_url,
        "FN_CELERY_QUEUE": queue,
        "FN_WORK_DIR": str(work),
        "FN_LEASE_SECONDS": str(LEASE_SECONDS),
    }
    args = [
        sys.executable, "-m", "celery", "-A", "tests.support.function_celery", "worker",
        "--pool=solo", "--concurrency=1", "-Q", queue, "--loglevel=WARNING",
        "--without-heartbeat", "--without-gossip", "--without-mingle",
        # A name of its own: its control queue must not clash with any other worker's.
        f"--hostname={name}-{uuid.uuid4().hex[:8]}@%h",
    ]  # fmt: skip
    worker = Child(args, env, name)
    wait_until(lambda: consumers(amqp_url, queue) >= 1, timeout=60, what=f"{name} to consume")
    return worker


class Workers:
    """This test's worker processes, and the app it sends tasks with; at the end all are
    stopped, and on a failure their last lines printed."""

    def __init__(self, amqp_url: str, queue: str, work: Path) -> None:
        from tests.support.function_celery import make_app

        self.amqp_url, self.queue, self.work = amqp_url, queue, work
        self.started: list[Child] = []
        self.sender = make_app(amqp_url, queue)

    def start(self, name: str) -> Child:
        self.started.append(start_worker(self.amqp_url, self.queue, self.work, name))
        return self.started[-1]

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            for worker in self.started:
                print(worker.tail())
        for worker in self.started:
            worker.terminate()
            worker.close()
        self.sender.close()


def consumers(amqp_url: str, queue: str) -> int:
    with Connection(amqp_url) as broker:
        try:
            declared = broker.default_channel.queue_declare(queue=queue, passive=True)
        except Exception:  # not declared yet: the worker declares it when it starts consuming
            return 0
        return int(declared.consumer_count)


def notes(work: Path, kind: str) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(work.glob(f"{kind}-*.json"))]


@pytest.mark.parametrize("stage", ["before_commit", "after_commit"])
def test_a_worker_killed_mid_task_and_redelivered_runs_the_effect_once(
    amqp_url: str, queue: str, tmp_path: Path, stage: str
):
    """``before_commit``: SIGKILLed inside the function's transaction, after its write; the
    write rolls back, the redelivery takes the dead worker's key over and runs the function
    again. ``after_commit``: killed after the commit, before the acknowledgement; the
    redelivery gets the stored result without running it."""
    order_id = uuid.uuid4().int % 10**9
    (tmp_path / "hold").touch()
    with Workers(amqp_url, queue, tmp_path) as workers:
        doomed = workers.start("doomed")
        workers.sender.send_task("fn.charge", kwargs={"order_id": order_id, "stage": stage})
        held = "effect" if stage == "before_commit" else "result"
        wait_until(lambda: notes(tmp_path, held), timeout=60, what="the task to reach its hold")
        committed = Widget.objects.filter(name=f"fn-order-{order_id}").count()
        assert committed == (1 if stage == "after_commit" else 0)

        doomed.kill()
        killed_at = time.monotonic()
        (tmp_path / "hold").unlink()
        successor = workers.start("next")
        wait_until(
            lambda: len(notes(tmp_path, "result")) == (2 if stage == "after_commit" else 1),
            timeout=90,
            what="the redelivery's result",
        )
        redelivered_after = time.monotonic() - killed_at
        assert successor.alive(), successor.tail()

    widgets = Widget.objects.filter(name=f"fn-order-{order_id}")
    assert widgets.count() == 1  # the effect, once
    record = IdempotencyRecord.objects.get(key=str(order_id))
    assert record.status == COMPLETED
    expected = {"order_id": order_id, "widget": widgets.get().pk}
    results = notes(tmp_path, "result")
    assert all(result["retval"] == expected for result in results), results
    effects = notes(tmp_path, "effect")
    if stage == "before_commit":
        # Ran twice, committed once: the killed run's write died with its transaction.
        assert len(effects) == 2 and effects[0]["pid"] != effects[1]["pid"]
        assert record.attempts == 2  # the redelivery took the dead worker's key over
        if not ON_SQLITE:
            # Taken over as soon as the dead worker's session was gone, not after the lease.
            assert redelivered_after < LEASE_SECONDS, redelivered_after
    else:
        assert len(effects) == 1 and record.attempts == 1  # the redelivery replayed
    assert queue_depth(amqp_url, queue) == 0


@pytest.mark.urls("tests.support.handoff_urls")
@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="in the PostgreSQL pass: what the kill tests is the worker's transaction rolling "
    "back and the redelivery taking the key up, which tests/request/test_handoff.py holds per "
    "backend",
)
def test_handed_off_work_killed_mid_run_and_redelivered_runs_once(
    amqp_url: str, queue: str, tmp_path: Path
):
    """A view hands a widget to a worker (202); the worker is SIGKILLed inside the work's
    transaction, after its write; the redelivery to another worker runs it again at once (the
    key is still ACCEPTED under the same token: a worker's hold does not wait for a lease) and
    stores the final response once."""
    from tests.testapp.handoff import DOORS

    key = f"handoff-{uuid.uuid4().hex[:10]}"
    accepted = Client().post(
        DOORS["decorator"], {"name": key}, content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )  # fmt: skip
    assert accepted.status_code == 202
    payload = OutboxEvent.objects.get(topic="tests.make_widget").payload
    (tmp_path / "hold").touch()
    with Workers(amqp_url, queue, tmp_path) as workers:
        doomed = workers.start("doomed")
        # As the relay's CeleryPublisher sends it: the payload as the task's keyword arguments.
        workers.sender.send_task("fn.handed_off", kwargs=payload)
        wait_until(lambda: notes(tmp_path, "effect"), timeout=60, what="the work to start")
        doomed.kill()
        (tmp_path / "hold").unlink()
        successor = workers.start("next")
        wait_until(lambda: notes(tmp_path, "outcome"), timeout=90, what="the redelivery")
        assert successor.alive(), successor.tail()

    widgets = Widget.objects.filter(name=f"handoff-{key}")
    assert widgets.count() == 1  # the killed run's write rolled back; the redelivery's stayed
    assert [note["retval"] for note in notes(tmp_path, "outcome")] == ["completed"]
    effects = notes(tmp_path, "effect")
    assert len(effects) == 2 and effects[0]["pid"] != effects[1]["pid"]
    record = IdempotencyRecord.objects.get(key=key)
    assert record.status == COMPLETED and record.response_status == 200
    replay = Client().post(
        DOORS["decorator"], {"name": key}, content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )  # fmt: skip
    assert replay.status_code == 200 and replay.json() == {"widget": widgets.get().pk}
    assert queue_depth(amqp_url, queue) == 0
