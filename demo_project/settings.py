"""Settings for the demo payments service. Every knob is an environment variable.

With none set, the demo needs nothing but Python: SQLite, no Redis, no broker.

``DATABASE_URL``       any database django-environ understands (default: ``demo.sqlite3``).
``REDIS_URL``          optional: defines the ``idempotency`` django-redis cache and keeps the
                       Redis copy (``IDEMPOTENCY["CACHE_ALIAS"]``) in it.
``CELERY_BROKER_URL``  optional: sends tasks (the outbox relay, the ledger consumer) to a broker
                       for a Celery worker; without it they run in-process, after the commit.
``DEMO_FAULTS``        off by default: lets a request ask for a slow or crashing payment with the
                       ``X-Demo-Fault`` header (``make demo`` turns it on for the tour).
``IDEMPOTENCY_LEASE_SECONDS`` / ``IDEMPOTENCY_TTL_SECONDS``  the lease and retention of keys.
``IDEMPOTENCY_RELAY_LEASE_SECONDS``  how long a relay holds the events it claimed.
``DEMO_PAYOUT_SECONDS``  how long a payout (``POST /api/v1/payouts/``, 202) takes in the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import environ

from django_idempotency.tasks import BEAT_SCHEDULE

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()

DEBUG = env.bool("DEBUG", default=True)
SECRET_KEY = env("SECRET_KEY", default="demo-only-change-me")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["*"])

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'demo.sqlite3'}")
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # IMMEDIATE transactions make concurrent writers queue instead of failing with
    # "database is locked"; WAL lets readers (and 409 answers) through while one writes.
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL;",
    }
elif DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    DATABASES["default"].setdefault("OPTIONS", {})["charset"] = "utf8mb4"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_idempotency",
    "demo_project.payments",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "demo_project.urls"
WSGI_APPLICATION = "demo_project.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REST_FRAMEWORK: dict[str, Any] = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.BasicAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # The quick start lets curl in without credentials: those requests share the one anonymous
    # scope (IDEMPOTENCY["ANONYMOUS_SCOPE"]); the demo user's keys live in a scope of its own.
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    # The browsable API with an Idempotency-Key field, so its forms can pay and refund.
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "django_idempotency.drf.browsable.IdempotentBrowsableAPIRenderer",
    ],
}

IDEMPOTENCY: dict[str, Any] = {
    "LEASE_SECONDS": env.float("IDEMPOTENCY_LEASE_SECONDS", default=30),
    "TTL_SECONDS": env.float("IDEMPOTENCY_TTL_SECONDS", default=86400),
    "OUTBOX_RELAY_LEASE_SECONDS": env.float("IDEMPOTENCY_RELAY_LEASE_SECONDS", default=60),
    "ANONYMOUS_SCOPE": "anonymous",
}

CACHES: dict[str, Any] = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}
REDIS_URL = env("REDIS_URL", default="")
if REDIS_URL:
    CACHES["idempotency"] = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        # A Redis that hangs costs a request half a second, then the database answers (W040).
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.DefaultClient",
            "SOCKET_CONNECT_TIMEOUT": 0.5,
            "SOCKET_TIMEOUT": 0.5,
        },
    }
    IDEMPOTENCY["CACHE_ALIAS"] = "idempotency"

# Celery reads every CELERY_* setting here (see demo_project/celery.py). Without a broker the
# tasks run in-process, so the demo needs nothing else running.
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="")
CELERY_TASK_ALWAYS_EAGER = not CELERY_BROKER_URL
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", default="demo")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The broker confirms every message the relay sends before the event counts as published, and
# a worker takes one message at a time (the ledger tasks acknowledge late).
CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Beat relays the outbox every 10 s (the safety net behind the kick after each commit) and
# sweeps expired keys, published events and old processed-message markers.
CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE}

# Each payment event goes to its ledger task, each payout to the task that sends it. With a
# broker, CeleryPublisher sends it (the task id is the event id) and the worker runs it; without
# one, the relay runs in the web process and hands the event straight to the task
# (demo_project/payments/inprocess.py).
TOPIC_TASKS = {
    "payment.completed": "demo_project.payments.tasks.record_payment",
    "payment.refunded": "demo_project.payments.tasks.record_refund",
    # POST /api/v1/payouts/ hands each payout to this task under the request's key (202).
    "payout.requested": "demo_project.payments.tasks.send_payout",
}
TASK_PUBLISHER: dict[str, Any] = (
    {
        "BACKEND": "django_idempotency.publishers.celery.CeleryPublisher",
        "OPTIONS": {"app": "demo_project.celery.app"},
    }
    if CELERY_BROKER_URL
    else {"BACKEND": "demo_project.payments.inprocess.InProcessTaskPublisher", "OPTIONS": {}}
)
IDEMPOTENCY["OUTBOX_PUBLISHERS"] = {
    topic: {**TASK_PUBLISHER, "OPTIONS": {**TASK_PUBLISHER["OPTIONS"], "task": task}}
    for topic, task in TOPIC_TASKS.items()
}
#: How long a payout's bank transfer takes in the worker (POST /api/v1/payouts/).
DEMO_PAYOUT_SECONDS = env.float("DEMO_PAYOUT_SECONDS", default=2.0)
# Every topic the demo publishes has its route above, so no catch-all route is needed (the
# check warns when there is none, since an unrouted topic fails publish()).
SILENCED_SYSTEM_CHECKS = ["django_idempotency.W024"]
# After each commit that published, the kick queues the relay task from a background thread:
# to the broker, where a worker relays; or, without one, Celery's eager mode runs the relay right
# there in the web process. Either way the response never waits for it.
IDEMPOTENCY["OUTBOX_KICK"] = "django_idempotency.tasks.kick_relay"

#: Fault injection for the tour: never turn it on outside the demo.
DEMO_FAULTS = env.bool("DEMO_FAULTS", default=False)

# The OpenAPI schema (drf-spectacular) and Swagger UI, whose files come from
# drf-spectacular-sidecar and are served by this app like the admin's (see demo_project/urls.py):
# the front page works without internet.
INSTALLED_APPS += ["drf_spectacular", "drf_spectacular_sidecar"]
REST_FRAMEWORK["DEFAULT_SCHEMA_CLASS"] = "drf_spectacular.openapi.AutoSchema"
SPECTACULAR_SETTINGS = {
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "TITLE": "django-idempotency demo payments API",
    "DESCRIPTION": (
        "Payments between seeded accounts. POST and PATCH take an Idempotency-Key header: "
        "retry with the same key and you get the first answer back, never a second payment."
    ),
    "VERSION": "1.0.0",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "demo_project.payments.schema.document_not_found",
        "demo_project.payments.schema.link_payments",
    ],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_idempotency": {"handlers": ["console"], "level": "INFO"}},
}
