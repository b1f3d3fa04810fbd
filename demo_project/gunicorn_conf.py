"""Gunicorn settings for the demo: ``gunicorn --config python:demo_project.gunicorn_conf ...``.

Gunicorn, not runserver, because the tour kills a worker in the middle of a payment: the master
starts a new one and the service stays up, as it would in production. ``GUNICORN_CMD_ARGS``
(for example ``--bind 0.0.0.0:8000``) overrides anything here.
"""

import os
from typing import Any

bind = ["127.0.0.1:8000"]
# Two processes, so a worker that dies leaves the other one serving; threads, so a slow payment
# does not hold up the duplicate that arrives while it runs.
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
threads = 4
timeout = 60
accesslog = "-"
# Recent gunicorn releases open a control socket at one fixed path per user; several servers on
# one machine (the tests start their own) would fight over it, and the demo does not use it.
control_socket_disable = True


def post_worker_init(worker: Any) -> None:
    """Without a broker there is no beat: each web worker kicks the outbox relay now and then."""
    from django.conf import settings

    if not settings.CELERY_BROKER_URL:
        from demo_project.payments.inprocess import start_relay_beat

        start_relay_beat()
