"""The Celery app the relay benchmark publishes through (``CeleryPublisher``'s ``app``): the
broker is ``AMQP_URL``, with publisher confirms, as a careful deployment runs it."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("bench-relay", broker=os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1//"))
app.conf.broker_transport_options = {"confirm_publish": True}
app.conf.task_create_missing_queues = True
