"""Settings for the test suite; ``TEST_DATABASE`` picks sqlite, postgresql or mariadb."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import environ

from tests.support.backends import ENV_VARS, BackendUnavailable, service_url

BASE_DIR = Path(__file__).resolve().parent
TEST_DATABASE = os.environ.get("TEST_DATABASE", "sqlite")

# One SQLite file per test run (per xdist worker), shared with the server processes the tests
# start, which inherit the variable.
os.environ.setdefault(
    "IDEMPOTENCY_TEST_SQLITE",
    str(Path(tempfile.gettempdir()) / f"django_idempotency_test_{os.getpid()}.sqlite3"),
)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and not os.environ["IDEMPOTENCY_TEST_SQLITE"].endswith(f"-{_WORKER}"):
    os.environ["IDEMPOTENCY_TEST_SQLITE"] += f"-{_WORKER}"


def _database() -> dict[str, Any]:
    if TEST_DATABASE == "sqlite":
        path = os.environ["IDEMPOTENCY_TEST_SQLITE"]
        config: dict[str, Any] = {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path,
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL;",
            },
            "TEST": {"NAME": path},
        }
    else:
        url = service_url(TEST_DATABASE)
        if url is None:
            raise BackendUnavailable(
                f"TEST_DATABASE={TEST_DATABASE} but no server is reachable; "
                f"set {ENV_VARS[TEST_DATABASE]} or start Docker."
            )
        config = environ.Env.db_url_config(url)
        if TEST_DATABASE == "mariadb":
            config["OPTIONS"] = {"charset": "utf8mb4"}
            config["TEST"] = {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"}
    # Server processes started by a test connect to the test database, not the base one.
    if os.environ.get("TEST_DATABASE_NAME"):
        config["NAME"] = os.environ["TEST_DATABASE_NAME"]
    elif _WORKER and TEST_DATABASE != "sqlite":
        # Each xdist worker its own databases, named here rather than by pytest-django, so that
        # every name derived from this one (the records' database) carries the worker too.
        config["NAME"] = f"{config['NAME']}_{_WORKER}"
    return config


SECRET_KEY = "tests-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
DATABASES = {"default": _database()}
# A second database on the same server, for tests that route the idempotency records away from
# the business data (DATABASE_ROUTERS); created only for the tests that ask for it.
DATABASES["records"] = {**DATABASES["default"], "TEST": {**DATABASES["default"].get("TEST", {})}}
if TEST_DATABASE == "sqlite":
    DATABASES["records"]["NAME"] = DATABASES["records"]["TEST"]["NAME"] = (
        os.environ["IDEMPOTENCY_TEST_SQLITE"] + "-records"
    )
else:
    DATABASES["records"]["NAME"] = f"{DATABASES['default']['NAME']}_records"
    DATABASES["records"]["TEST"]["NAME"] = f"test_{DATABASES['default']['NAME']}_records"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_idempotency",
    "tests.testapp",
    # The demo's payments app, for its ledger consumer tests (tests/demo/test_ledger.py).
    "demo_project.payments",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_idempotency.request.middleware.IdempotencyMiddleware",
]
ROOT_URLCONF = "tests.testapp.urls"
STATIC_URL = "static/"
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
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
IDEMPOTENCY: dict[str, Any] = {
    "MIDDLEWARE_PATHS": [r"^/plain/middleware/", r"^/async/", r"^/doors/middleware/"],
    "STORED_RESPONSE_HEADERS": ["Content-Type", "Location", "X-Widget-Id"],
    # Tests relay explicitly; the default kick would queue Celery tasks on a real broker.
    "OUTBOX_PUBLISHERS": {"*": "django_idempotency.publishers.memory.MemoryPublisher"},
    "OUTBOX_KICK": None,
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"django_idempotency": {"handlers": ["null"], "level": "DEBUG"}},
}
if os.environ.get("IDEMPOTENCY_TEST_LEASE_SECONDS"):
    IDEMPOTENCY["LEASE_SECONDS"] = float(os.environ["IDEMPOTENCY_TEST_LEASE_SECONDS"])
if os.environ.get("IDEMPOTENCY_TEST_TAKE_OVER_DEAD_OWNERS"):
    IDEMPOTENCY["TAKE_OVER_DEAD_OWNERS"] = os.environ["IDEMPOTENCY_TEST_TAKE_OVER_DEAD_OWNERS"]
# Tables partitioned by day for the whole run, "outbox,inbox" say (PostgreSQL; tests/conftest.py
# moves them): tests/outbox/test_partitions.py runs the relay's and the inbox's tests so.
PARTITIONED_TABLES = [
    label for label in os.environ.get("IDEMPOTENCY_TEST_PARTITIONED", "").split(",") if label
]
for _label in PARTITIONED_TABLES:
    IDEMPOTENCY[{"outbox": "OUTBOX_PARTITIONS", "inbox": "INBOX_PARTITIONS"}[_label]] = True
