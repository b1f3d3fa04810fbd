"""docs/howto/celery-beat.md, followed literally in a fresh virtual environment, with the
mechanism of tests/test_quickstart.py: from ``pip install`` to a worker and beat on RabbitMQ,
then django-celery-beat.

The page's blocks are marked ``<!-- howto: ... -->``. Besides the checkout's path, the project's
queue and its worker's node name change on the way (``mysite`` becomes a name of this run's
own), so that runs sharing the broker never take each other's tasks.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

from kombu import Connection, Queue

from tests.slow import ROOT, once_per_run
from tests.test_quickstart import Reader, follow, reader_in, steps

pytestmark = once_per_run

PAGE = ROOT / "docs" / "howto" / "celery-beat.md"
PAGE_BROKER = "amqp://guest:guest@127.0.0.1:5672//"
#: What an operator does in the admin for the relay's periodic task: another interval and
#: expiry, saved (the admin's change form saves the instance, as here).
CHANGE_IN_THE_ADMIN = """python manage.py shell --verbosity 0 -c '
from django_celery_beat.models import IntervalSchedule, PeriodicTask
task = PeriodicTask.objects.get(name="django-idempotency-relay-outbox")
task.interval, _ = IntervalSchedule.objects.get_or_create(every=2, period="seconds")
task.expire_seconds = 1
task.save()
'"""
READ_THE_ENTRY = """python manage.py shell --verbosity 0 -c '
from django_celery_beat.models import PeriodicTask
task = PeriodicTask.objects.get(name="django-idempotency-relay-outbox")
print(task.interval.every, task.interval.period, task.expire_seconds)
'"""


def test_the_page_marks_every_step_the_test_needs() -> None:
    actions = [step.action for step in steps(PAGE.read_text(), "howto")]
    assert {"run", "write", "append", "start"} <= set(actions)
    assert set(actions) <= {"run", "write", "append", "start"}
    starts = [step.arguments for step in steps(PAGE.read_text(), "howto") if step.action == "start"]
    assert starts == [["worker"], ["beat"], ["beat"]]


def wait_for_relay(reader: Reader) -> None:
    """Beat sent the relay and the worker ran it."""
    deadline = time.monotonic() + 60
    finished = re.compile(r"django_idempotency\.tasks\.relay_outbox\[[^\]]+\] succeeded")
    while not finished.search(reader.output("worker")):
        assert time.monotonic() < deadline, reader.output("worker")[-3000:]
        time.sleep(0.2)


def test_the_howto_works_as_written(tmp_path: Path, amqp_url: str) -> None:
    project = f"howto-{uuid.uuid4().hex[:10]}"
    page_steps = steps(PAGE.read_text(), "howto")
    try:
        with reader_in(tmp_path) as reader:
            reader.replacements = {
                'CELERY_TASK_DEFAULT_QUEUE = "mysite"': f'CELERY_TASK_DEFAULT_QUEUE = "{project}"',
                "-n mysite@%h": f"-n {project}@%h",
                PAGE_BROKER: amqp_url,
            }
            follow(page_steps, reader, PAGE)

            # Behind the page's back: an interval changed in the admin survives beat's restart,
            # and beat and the worker relay by it.
            reader.shell(CHANGE_IN_THE_ADMIN)
            (*_, last_beat) = (step for step in page_steps if step.action == "start")
            reader.start(
                "beat", last_beat.body, ready="Sending due task django-idempotency-relay-outbox"
            )
            wait_for_relay(reader)
            assert reader.shell(READ_THE_ENTRY).strip() == "2 seconds 1"
    finally:
        with Connection(amqp_url) as connection:
            Queue(project, no_declare=True)(connection.default_channel).delete()
