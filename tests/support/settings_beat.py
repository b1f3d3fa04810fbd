"""Test settings with django-celery-beat installed, for the beat processes and commands that
tests/operations/test_tasks_celery_beat.py runs against a database of their own
(``TEST_DATABASE_NAME``).

With ``BEAT_SCHEDULE_MODE=shipped`` the settings merge ``BEAT_SCHEDULE`` into
``CELERY_BEAT_SCHEDULE``, as a project on Celery's own scheduler does.
"""

import os

from django_idempotency.tasks import BEAT_SCHEDULE
from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_beat"]
CELERY_BEAT_SCHEDULE = (
    {**BEAT_SCHEDULE} if os.environ.get("BEAT_SCHEDULE_MODE") == "shipped" else {}
)
