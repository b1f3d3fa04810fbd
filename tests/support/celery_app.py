"""The Celery app of the test suite, and of the worker processes the end-to-end tests start.

``celery -A tests.support.celery_app worker`` sets Django up with the test settings; the worker then
uses the database named by ``TEST_DATABASE_NAME`` (see settings.py) and the broker in
``AMQP_URL``, consuming ``TEST_CELERY_QUEUE``.
"""

from __future__ import annotations

import os

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

app = Celery("tests", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("AMQP_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    broker_transport_options={"confirm_publish": True},
    task_default_queue=os.environ.get("TEST_CELERY_QUEUE", "celery"),
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    result_backend=None,
    task_ignore_result=True,
)

import tests.testapp.tasks  # noqa: E402,F401  (registers the tasks on every app)
