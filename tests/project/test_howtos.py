"""The quick start, then every how-to guide in the order of the navigation, followed literally
in one fresh project and one fresh virtual environment, with the mechanism of
``tests/project/test_quickstart.py``: each guide's "Try it" steps build on the quick start's project
and on the guides before it (the marker word is ``howto``).

Besides the checkout's path and the server's address, the project's queue and its worker's node
name change on the way (``mysite`` becomes a name of this run's own), so that runs sharing the
broker never take each other's tasks; and the broker is this run's.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import yaml
from kombu import Connection, Queue

from tests.project.test_docs import MkDocsLoader, nav_pages
from tests.project.test_quickstart import PAGE as QUICKSTART
from tests.project.test_quickstart import follow, reader_in, steps
from tests.support.slow import ROOT, once_per_run

pytestmark = once_per_run

DOCS = ROOT / "docs"
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


def howto_pages() -> list[Path]:
    """The how-to guides, in the order of the navigation."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=MkDocsLoader)  # noqa: S506
    return [DOCS / page for page in nav_pages(config["nav"]) if page.startswith("howto/")]


def test_every_howto_has_steps_to_follow() -> None:
    pages = howto_pages()
    assert {page.name for page in pages} == {path.name for path in (DOCS / "howto").glob("*.md")}
    for page in pages:
        text = page.read_text()
        assert steps(text, "howto"), f"{page.name} has no <!-- howto: ... --> step"
        assert "## Try it in the quick start's project" in text or "quick start" in text, page


def test_the_quickstart_and_then_every_howto_in_one_project(tmp_path: Path, amqp_url: str) -> None:
    project = f"howto-{uuid.uuid4().hex[:10]}"
    try:
        with reader_in(tmp_path) as reader:
            reader.replacements = {
                'CELERY_TASK_DEFAULT_QUEUE = "mysite"': f'CELERY_TASK_DEFAULT_QUEUE = "{project}"',
                "-n mysite@%h": f"-n {project}@%h",
                PAGE_BROKER: amqp_url,
            }
            follow(steps(QUICKSTART.read_text()), reader, QUICKSTART)
            # What the quick start promises, checked behind its back: one payment, refunded,
            # one event.
            state = reader.shell(
                "python manage.py shell --verbosity 0 -c '"
                "from payments.models import Payment; "
                "from django_idempotency.models import OutboxEvent; "
                "print([p.status for p in Payment.objects.all()], OutboxEvent.objects.count())'"
            )
            assert state.strip() == "['refunded'] 1"
            for page in howto_pages():
                follow(steps(page.read_text(), "howto"), reader, page)

            # Behind the pages' back: an interval changed in the admin survives beat's restart,
            # and beat and the worker relay by it.
            reader.shell(CHANGE_IN_THE_ADMIN)
            beat = DOCS / "howto" / "celery-beat.md"
            (*_, last_beat) = (s for s in steps(beat.read_text(), "howto") if s.action == "start")
            reader.start(
                "beat", last_beat.body, ready="Sending due task django-idempotency-relay-outbox"
            )
            assert reader.shell(READ_THE_ENTRY).strip() == "2 seconds 1"
            # And the whole project passes its checks.
            assert "no issues" in reader.shell("python manage.py check --fail-level ERROR")
    finally:
        with Connection(amqp_url) as connection:
            Queue(project, no_declare=True)(connection.default_channel).delete()
