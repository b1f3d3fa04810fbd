"""The Celery app and tasks of the worker processes the Celery fault tests start and kill.

``celery -A tests.reliability.outbox_celery worker`` consumes ``REL_CELERY_QUEUE`` on the broker
in ``REL_AMQP_URL``, with the database named by ``TEST_DATABASE_NAME``. Every task is an
idempotent consumer writing a Widget, so counting widgets counts effects. Each delivery's start
and end go to ``deliveries-<pid>.log`` in ``REL_WORK_DIR``, so the tests count deliveries apart
from effects and see which ran at the same time. The ``hold_*`` tasks also note each run, then
wait while a ``hold`` file exists there: that is when the tests kill the worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import django
from celery import Celery
from celery.signals import task_postrun, task_prerun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django_idempotency.inbox import consume_once, idempotent_consumer  # noqa: E402
from tests.testapp.models import Widget  # noqa: E402

#: How long a held task waits at most: the test kills the worker long before.
HOLD_LIMIT = 120.0


def make_app(broker_url: str, queue: str) -> Celery:
    """The worker's app, and the app the tests send with: the same configuration."""
    app = Celery("rel-celery", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"confirm_publish": True},
        task_default_queue=queue,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
        result_backend=None,
    )
    return app


app = make_app(
    os.environ.get("REL_AMQP_URL", "memory://"), os.environ.get("REL_CELERY_QUEUE", "celery")
)


def _work_dir() -> Path:
    return Path(os.environ["REL_WORK_DIR"])


def _log_delivery(event: str, task_id: str | None, task: Any) -> None:
    # The signals are global: leave other apps' tasks (the rest of the suite's) alone.
    if getattr(task, "app", None) is app and "REL_WORK_DIR" in os.environ:
        # Whether the broker delivered this message before (it requeued it unacknowledged).
        again = bool((task.request.delivery_info or {}).get("redelivered"))
        with open(_work_dir() / f"deliveries-{os.getpid()}.log", "a") as log:
            log.write(f"{event} {task_id} {time.time():.4f} {int(again)}\n")


@task_prerun.connect
def _delivery_started(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    _log_delivery("start", task_id, task)


@task_postrun.connect
def _delivery_ended(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    _log_delivery("end", task_id, task)


def _note_run(task: Any, *, duplicate: bool) -> None:
    run = {
        "pid": os.getpid(),
        "redelivered": bool((task.request.delivery_info or {}).get("redelivered")),
        "duplicate": duplicate,
    }
    path = _work_dir() / f"run-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(run))


def _hold() -> None:
    deadline = time.monotonic() + HOLD_LIMIT
    while (_work_dir() / "hold").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@app.task(name="rel.hold_before_commit", bind=True, acks_late=True, reject_on_worker_lost=True)
@idempotent_consumer
def hold_before_commit(self: Any, name: str) -> None:
    """Writes its effect, then holds with the transaction (and the marker) uncommitted."""
    Widget.objects.create(name=name)
    _note_run(self, duplicate=False)
    _hold()


@app.task(name="rel.hold_after_commit", bind=True, acks_late=True, reject_on_worker_lost=True)
def hold_after_commit(self: Any, name: str) -> None:
    """Commits its effect and marker, then holds before the message is acknowledged."""
    with consume_once(self.name, self.request.id) as consumption:
        if consumption:
            Widget.objects.create(name=name)
    _note_run(self, duplicate=not consumption)
    _hold()


@app.task(name="rel.record", acks_late=True)
@idempotent_consumer
def record(name: str, linger: float = 0.0) -> None:
    """``linger`` keeps the transaction open a while, so a concurrent copy of the message
    meets the uncommitted marker."""
    Widget.objects.create(name=name)
    time.sleep(linger)
