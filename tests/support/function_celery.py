"""The Celery app and tasks of the worker processes
``tests/request/test_idempotent_function_celery.py`` starts and kills: a task that is an
``@idempotent_function``, stacked under ``@app.task``, and one that does the work a view handed off
(``@handed_off``, ``tests/request/test_handoff.py``).

``celery -A tests.support.function_celery worker`` consumes ``FN_CELERY_QUEUE`` on the broker in
``FN_AMQP_URL``, with the database named by ``TEST_DATABASE_NAME``. In ``FN_WORK_DIR`` the task
notes each time its effect runs (``effect-*.json``) and each result it returns
(``result-*.json``), and holds while a ``hold`` file exists: inside its transaction for the
``before_commit`` stage, after the commit but before the acknowledgement for ``after_commit``.
That is when the test kills the worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import django
from celery import Celery
from celery.signals import task_postrun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django_idempotency import idempotent_function  # noqa: E402
from django_idempotency.exceptions import IdempotentCallInProgress  # noqa: E402
from django_idempotency.request.handoff import handed_off  # noqa: E402
from tests.testapp.models import Widget  # noqa: E402

#: How long a held task waits at most: the test kills the worker long before.
HOLD_LIMIT = 120.0


def make_app(broker_url: str, queue: str) -> Celery:
    """The worker's app, and the app the test sends with: the same configuration."""
    app = Celery("fn-celery", set_as_current=False)
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


app = make_app(os.environ.get("FN_AMQP_URL", "memory://"), os.environ.get("FN_CELERY_QUEUE", "fn"))


def _work_dir() -> Path:
    return Path(os.environ["FN_WORK_DIR"])


def _note(kind: str, **values: Any) -> None:
    if "FN_WORK_DIR" not in os.environ:  # called in the test process, not a worker's
        return
    path = _work_dir() / f"{kind}-{time.monotonic_ns()}.json"
    # Written under another name, then renamed: the test polls these files, and must never
    # read one the worker has created but not yet filled.
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"pid": os.getpid(), **values}))
    partial.rename(path)


def _hold() -> None:
    if "FN_WORK_DIR" not in os.environ:
        return
    deadline = time.monotonic() + HOLD_LIMIT
    while (_work_dir() / "hold").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@app.task(
    name="fn.charge",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    # A redelivery that finds the key still held (the dead worker's lease, where the database
    # cannot tell that its owner is gone) tries again shortly.
    autoretry_for=(IdempotentCallInProgress,),
    default_retry_delay=1,
    max_retries=60,
)
@idempotent_function(key="order_id", lease=float(os.environ.get("FN_LEASE_SECONDS", "30")))
def charge(self: Any, order_id: int, stage: str) -> dict[str, Any]:
    """The effect: one Widget per order, in the transaction that stores the result."""
    widget = Widget.objects.create(name=f"fn-order-{order_id}")
    _note("effect", order_id=order_id)
    if stage == "before_commit":
        _hold()
    return {"order_id": order_id, "widget": widget.pk}


@app.task(name="fn.handed_off", bind=True, acks_late=True, reject_on_worker_lost=True)
@handed_off
def make_widget(self: Any, name: str, fail: bool = False, hold_file: str = "") -> dict[str, Any]:
    """Handed-off work (the payload of ``tests/testapp/handoff.py``'s views): a widget, in the
    transaction that stores the final response; held there while the ``hold`` file exists."""
    widget = Widget.objects.create(name=f"handoff-{name}", created_by="worker")
    _note("effect", name=name)
    _hold()
    return {"widget": widget.pk}


@task_postrun.connect
def _returned(task: Any = None, retval: Any = None, kwargs: Any = None, **_: Any) -> None:
    """After the task returned (its transaction committed), before the acknowledgement; not
    after a retry (``retval`` is then the exception)."""
    if getattr(task, "app", None) is not app:
        return
    if isinstance(retval, str):  # a handed-off task's outcome
        _note("outcome", retval=retval)
        return
    if not isinstance(retval, dict):
        return
    _note("result", retval=retval)
    if (kwargs or {}).get("stage") == "after_commit":
        _hold()
