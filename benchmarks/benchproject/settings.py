"""Benchmark-only settings: the demo's payments app, served in one of several variants.

``BENCH_VARIANT`` picks what guards ``POST /api/v1/payments/``: ``ours`` (database only),
``ours-redis`` (with the Redis copy), ``ours-memory`` (database only, answers kept in
each worker's memory for 5 s: ``LOCAL_REPLAY_SECONDS``), ``ours-middleware`` (the Redis
copy, guarded by ``IdempotencyMiddleware`` instead of the mixin; it scopes keys by the
``Authorization`` header every client sends: ``benchmarks.run.AUTHORIZATION``), or one
of the PyPI peers wired as their READMEs say (``dik``: django-idempotency-key, ``drfi-db`` /
``drfi-redis``: drf-idempotency, ``drfik``: drf-idempotencykey). ``all`` installs every app, for
migrations. ``<variant>-cold`` is a second server of a variant, with the same settings.
"""

from __future__ import annotations

import json
import os
from typing import Any

import environ

VARIANT = os.environ.get("BENCH_VARIANT", "ours")
# A second server of a variant, for keys it has never seen (the cold replay rows): the same
# settings, its own name in BENCH_VARIANT (the statement counter tells the servers apart by it).
VARIANT = VARIANT.removesuffix("-cold")
DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/idem_speed")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/2")

SECRET_KEY = "benchmark-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "benchmarks.benchproject.urls"
WSGI_APPLICATION = "benchmarks.benchproject.wsgi.application"

DATABASES = {"default": environ.Env.db_url_config(DATABASE_URL)}
DATABASES["default"]["CONN_MAX_AGE"] = None  # one connection per worker, as in production
# Moving money takes one transaction, idempotency or not: every variant's view runs in one.
# IdempotencyMixin opts its guarded methods out and opens its own around handler and response.
DATABASES["default"]["ATOMIC_REQUESTS"] = True
if os.environ.get("BENCH_DATABASE_NAME"):
    DATABASES["default"]["NAME"] = os.environ["BENCH_DATABASE_NAME"]
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["TEST"] = {"NAME": DATABASES["default"]["NAME"]}  # a file, not :memory:
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL;",
    }

CACHES: dict[str, Any] = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "redis": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "bench",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
    },
}

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "rest_framework",
    "demo_project.payments",
    "benchmarks.benchproject.notes",
    # The demo's payments app uses our models (its ledger consumer); the peers' rows do not
    # touch them.
    "django_idempotency",
]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
REST_FRAMEWORK = {
    # Every variant sees the same user without a query or a password hash: the scope is a user
    # (drf-idempotencykey insists on one) and authentication costs nothing in the comparison.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "benchmarks.benchproject.authentication.BenchUserAuthentication"
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "ERROR"}}

OURS = VARIANT in ("ours", "ours-redis", "ours-memory", "ours-middleware", "all")
if OURS:
    with_redis = VARIANT in ("ours-redis", "ours-middleware")
    IDEMPOTENCY: dict[str, Any] = {"CACHE_ALIAS": "redis" if with_redis else None}
    if VARIANT == "ours-memory":
        IDEMPOTENCY["LOCAL_REPLAY_SECONDS"] = 5
    # An experiment's settings over ours (JSON), e.g. '{"METRICS": false}': what a feature costs
    # (benchmarks/NOTES.md). Never set by `make bench`.
    IDEMPOTENCY.update(json.loads(os.environ.get("BENCH_IDEMPOTENCY", "{}")))
if VARIANT == "ours-middleware":
    # The middleware answers a replay before the view, so before DRF: the caller is told by
    # the digest of its Authorization header (CREDENTIAL_HEADERS), which DRF checks on the
    # first request. The same endpoints as the mixin's rows, none of DRF's work on a replay.
    IDEMPOTENCY["MIDDLEWARE_PATHS"] = [r"^/api/v1/"]
    MIDDLEWARE.append("django_idempotency.request.middleware.IdempotencyMiddleware")
if VARIANT in ("dik", "all"):
    INSTALLED_APPS.append("idempotency_key")
    # README: the middleware makes every unsafe method require a key. Its default storage is
    # per-process memory, which cannot work behind several workers, so the Django cache (Redis).
    MIDDLEWARE.append("idempotency_key.middleware.IdempotencyKeyMiddleware")
    CACHES["default"] = CACHES["redis"]
    # CONFLICT_STATUS_CODE None: a repeat gets the stored response (its default is a 409).
    IDEMPOTENCY_KEY = {
        "STORAGE": {"CLASS": "idempotency_key.storage.CacheKeyStorage"},
        "CONFLICT_STATUS_CODE": None,
    }
if VARIANT in ("drfi-db", "drfi-redis", "all"):
    INSTALLED_APPS.append("drf_idempotency")
    if VARIANT != "all":  # its IDEMPOTENCY setting has the same name as ours
        MIDDLEWARE.append("drf_idempotency.middleware.IdempotencyMiddleware")
        IDEMPOTENCY = {
            "BACKEND": "drf_idempotency.backends.database.DatabaseBackend",
        }
        if VARIANT == "drfi-redis":
            IDEMPOTENCY = {
                "BACKEND": "drf_idempotency.backends.redis.RedisBackend",
                "BACKEND_OPTIONS": {"url": REDIS_URL},
            }
if VARIANT in ("drfik", "all"):
    INSTALLED_APPS.append("drf_idempotencykey")
if VARIANT == "all":
    IDEMPOTENCY = {}
