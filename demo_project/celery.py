"""The demo's Celery app: ``celery -A demo_project worker`` and ``celery -A demo_project beat``.

Configured from Django settings (the ``CELERY_`` names). Without ``CELERY_BROKER_URL`` tasks run
in-process, so the demo needs no broker.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

app = Celery("demo_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
