"""The Celery app of the worker and beat processes that tests/operations/test_tasks_celery_beat.py
starts and kills.

It runs the library's own tasks (``django_idempotency.tasks``) as a project would, with none of
the task options the suite's other apps set app-wide (no ``task_acks_late``): what the tasks do
when a worker dies is what their own decorators say. Configured from the environment:

``BEAT_AMQP_URL``, ``BEAT_QUEUE``   the broker and the queue (one per test) to send to and consume
``BEAT_WORK_DIR``                   where each process notes what it ran (``runs-<pid>.log``)
``BEAT_SCHEDULE_MODE``              ``shipped``: ``BEAT_SCHEDULE`` as it is; ``quick``: the same
                                    entries with their intervals and expiries scaled down alike
                                    (the relay every second, the sweeps every two), so that a test
                                    sees many periods in a few seconds; unset: the settings' own
                                    ``CELERY_BEAT_SCHEDULE``, if any

Test hooks, in the worker only: each task's start (with whether the broker redelivered it), end
(with what it returned) and expiry (a message dropped unrun) go to ``runs-<pid>.log``. When the
file ``hold-after`` holds a number N, a sweep stops after its N-th batch, writes ``held`` (its
pid) and waits while the file ``hold`` exists: that is when the tests kill it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import django
from celery import Celery
from celery.signals import task_postrun, task_prerun, task_revoked

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django.dispatch import receiver  # noqa: E402

from django_idempotency import signals  # noqa: E402
from django_idempotency.tasks import BEAT_SCHEDULE  # noqa: E402

#: The interval of each entry in the ``quick`` schedule, in seconds.
QUICK_INTERVALS = {"django-idempotency-relay-outbox": 1.0}
QUICK_SWEEP_INTERVAL = 2.0
#: How long a held sweep waits at most: the tests kill it long before.
HOLD_LIMIT = 60.0


def quick_schedule() -> dict[str, dict[str, Any]]:
    """``BEAT_SCHEDULE`` sped up: every interval and expiry shrunk by the same factor."""
    quick = {}
    for name, entry in BEAT_SCHEDULE.items():
        interval = QUICK_INTERVALS.get(name, QUICK_SWEEP_INTERVAL)
        factor = interval / entry["schedule"]
        options = dict(entry.get("options", {}))
        if "expires" in options:
            options["expires"] = options["expires"] * factor
        quick[name] = {**entry, "schedule": interval, "options": options}
    return quick


def make_app(broker_url: str, queue: str, schedule_mode: str = "") -> Celery:
    """A project's app: its ``CELERY_*`` settings, then this test's broker, queue and schedule."""
    app = Celery("beat-tests", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    app.conf.update(
        broker_url=broker_url,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"confirm_publish": True},
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
    )
    if schedule_mode:
        app.conf.beat_schedule = {"shipped": BEAT_SCHEDULE, "quick": quick_schedule()}[
            schedule_mode
        ]
    return app


app = make_app(
    os.environ.get("BEAT_AMQP_URL", "memory://"),
    os.environ.get("BEAT_QUEUE", "celery"),
    os.environ.get("BEAT_SCHEDULE_MODE", ""),
)
app.autodiscover_tasks(["django_idempotency"])


# --- test hooks ---------------------------------------------------------------------------------


def _work_dir() -> Path | None:
    directory = os.environ.get("BEAT_WORK_DIR")
    return Path(directory) if directory else None


def _note(*words: object) -> None:
    work = _work_dir()
    if work is not None:
        with open(work / f"runs-{os.getpid()}.log", "a") as log:
            # Nanoseconds first: the test sorts every process's notes by time, not by pid.
            log.write(" ".join(str(word) for word in (time.time_ns(), *words)) + "\n")


_batches_this_run = 0


@task_prerun.connect
def _started(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    global _batches_this_run
    _batches_this_run = 0
    redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
    _note("start", task.name, task_id, redelivered)


@task_postrun.connect
def _ended(task_id: str | None = None, task: Any = None, retval: Any = None, **_: Any) -> None:
    _note("end", task.name, task_id, str(retval).replace(" ", ""))


@task_revoked.connect
def _dropped(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    _note("expired" if expired else "revoked", sender.name, request.id)


@receiver(signals.rows_swept)
def _hold_after_batches(sender: Any, **_: Any) -> None:
    global _batches_this_run
    _batches_this_run += 1
    work = _work_dir()
    if work is None or not (work / "hold-after").exists():
        return
    if _batches_this_run != int((work / "hold-after").read_text()):
        return
    (work / "held").write_text(str(os.getpid()))
    deadline = time.monotonic() + HOLD_LIMIT
    while (work / "hold").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
