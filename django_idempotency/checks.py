"""System checks for the ``IDEMPOTENCY`` settings. Ids are stable and never reused."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.conf import DEFAULTS, SENSITIVE_HEADERS

E001 = "django_idempotency.E001"  # IDEMPOTENCY is not a dict
E002 = "django_idempotency.E002"  # LEASE_SECONDS not a positive number
E003 = "django_idempotency.E003"  # TTL_SECONDS not a positive number
E004 = "django_idempotency.E004"  # TTL_SECONDS shorter than LEASE_SECONDS
E005 = "django_idempotency.E005"  # SCOPE_RESOLVER does not import or is not callable
E006 = "django_idempotency.E006"  # STORED_STATUS_CODES not HTTP status codes
E007 = "django_idempotency.E007"  # STORED_RESPONSE_HEADERS not header names
E008 = "django_idempotency.E008"  # MAX_RESPONSE_BYTES not a non-negative integer
E009 = "django_idempotency.E009"  # a header-name setting is not a valid header name
E010 = "django_idempotency.E010"  # MIDDLEWARE_PATHS not valid regular expressions
E011 = "django_idempotency.E011"  # a boolean setting is not a bool
E012 = "django_idempotency.E012"  # MIDDLEWARE_METHODS not HTTP methods
W001 = "django_idempotency.W001"  # unknown key in IDEMPOTENCY
W002 = "django_idempotency.W002"  # STORED_RESPONSE_HEADERS lists a header never stored
W003 = "django_idempotency.W003"  # SQLite without IMMEDIATE transactions outside DEBUG
W004 = "django_idempotency.W004"  # middleware placed before AuthenticationMiddleware
E040 = "django_idempotency.E040"  # CACHE_ALIAS is not None or a configured cache alias
E041 = "django_idempotency.E041"  # CACHE_ALIAS names a cache that is not django-redis
E042 = "django_idempotency.E042"  # CACHE_RETRY_SECONDS is not a number >= 0
W040 = "django_idempotency.W040"  # the CACHE_ALIAS cache has no socket timeouts
E060 = "django_idempotency.E060"  # REGISTER_ADMIN, METRICS or TRACING is not a bool
W060 = "django_idempotency.W060"  # METRICS set to True but prometheus_client is not installed
W061 = "django_idempotency.W061"  # TRACING set to True but opentelemetry-api is not installed

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_BOOLEANS = ("KEY_REQUIRED", "LEASE_HEARTBEAT", "LOG_KEYS")
_HEADER_SETTINGS = ("HEADER", "REPLAY_HEADER")


@register(Tags.compatibility)
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    user = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user, dict):
        return [
            Error(
                "IDEMPOTENCY must be a dict.",
                hint="Set IDEMPOTENCY = {...} with the settings to change, or remove it.",
                id=E001,
            )
        ]
    merged = {**DEFAULTS, **user}
    errors: list[CheckMessage] = []
    for name in sorted(set(user) - set(DEFAULTS)):
        errors.append(
            Warning(
                f"IDEMPOTENCY[{name!r}] is not a known setting and is ignored.",
                hint="Check its spelling against the settings reference.",
                id=W001,
            )
        )
    errors += _check_durations(merged)
    errors += _check_scope_resolver(merged["SCOPE_RESOLVER"])
    errors += _check_status_codes(merged["STORED_STATUS_CODES"])
    errors += _check_stored_headers(merged["STORED_RESPONSE_HEADERS"])
    errors += _check_middleware(merged["MIDDLEWARE_PATHS"], merged["MIDDLEWARE_METHODS"])
    max_bytes = merged["MAX_RESPONSE_BYTES"]
    if not _is_int(max_bytes) or max_bytes < 0:
        errors.append(
            Error(
                f"IDEMPOTENCY['MAX_RESPONSE_BYTES'] must be a non-negative integer, "
                f"not {max_bytes!r}.",
                hint="Responses larger than this are recorded without their body.",
                id=E008,
            )
        )
    for name in _HEADER_SETTINGS:
        value = merged[name]
        if not isinstance(value, str) or not _TOKEN.match(value):
            errors.append(
                Error(
                    f"IDEMPOTENCY[{name!r}] must be an HTTP header name, not {value!r}.",
                    hint="Use letters, digits and dashes, for example 'Idempotency-Key'.",
                    id=E009,
                )
            )
    for name in _BOOLEANS:
        if not isinstance(merged[name], bool):
            errors.append(
                Error(f"IDEMPOTENCY[{name!r}] must be True or False.", hint=None, id=E011)
            )
    return errors


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_durations(merged: dict[str, Any]) -> list[CheckMessage]:
    lease, ttl = merged["LEASE_SECONDS"], merged["TTL_SECONDS"]
    errors: list[CheckMessage] = []
    if not _is_number(lease) or lease <= 0:
        errors.append(
            Error(
                f"IDEMPOTENCY['LEASE_SECONDS'] must be a positive number, not {lease!r}.",
                hint="Set it a little above the longest time an idempotent view takes.",
                id=E002,
            )
        )
    if not _is_number(ttl) or ttl <= 0:
        errors.append(
            Error(
                f"IDEMPOTENCY['TTL_SECONDS'] must be a positive number, not {ttl!r}.",
                hint="Set it to how long clients may retry, for example 86400 (24 hours).",
                id=E003,
            )
        )
    if not errors and ttl < lease:
        errors.append(
            Error(
                f"IDEMPOTENCY['TTL_SECONDS'] ({ttl}) is shorter than LEASE_SECONDS ({lease}).",
                hint="A key must outlive the lease of the request that holds it.",
                id=E004,
            )
        )
    return errors


def _check_scope_resolver(value: Any) -> list[CheckMessage]:
    try:
        resolver = import_string(value) if isinstance(value, str) else value
    except ImportError as exc:
        return [
            Error(
                f"IDEMPOTENCY['SCOPE_RESOLVER'] = {value!r} does not import: {exc}.",
                hint="Use the dotted path of a callable taking the request and returning a str.",
                id=E005,
            )
        ]
    if not callable(resolver):
        return [
            Error(
                f"IDEMPOTENCY['SCOPE_RESOLVER'] = {value!r} is not callable.",
                hint="Use the dotted path of a callable taking the request and returning a str.",
                id=E005,
            )
        ]
    return []


def _check_status_codes(value: Any) -> list[CheckMessage]:
    valid = isinstance(value, Iterable) and not isinstance(value, str | bytes)
    if valid:
        codes = list(value)
        valid = bool(codes) and all(_is_int(code) and 100 <= code <= 599 for code in codes)
    if valid:
        return []
    return [
        Error(
            "IDEMPOTENCY['STORED_STATUS_CODES'] must be a collection of HTTP status codes.",
            hint="For example range(100, 500), the default, which stores all but 5xx.",
            id=E006,
        )
    ]


def _check_stored_headers(value: Any) -> list[CheckMessage]:
    is_list = isinstance(value, Iterable) and not isinstance(value, str | bytes)
    names: list[Any] = list(value) if is_list else []
    if not is_list or not all(isinstance(name, str) and _TOKEN.match(name) for name in names):
        return [
            Error(
                "IDEMPOTENCY['STORED_RESPONSE_HEADERS'] must be a list of header names.",
                hint="For example ['Content-Type', 'Location'].",
                id=E007,
            )
        ]
    sensitive = sorted(name for name in names if name.lower() in SENSITIVE_HEADERS)
    if sensitive:
        return [
            Warning(
                f"IDEMPOTENCY['STORED_RESPONSE_HEADERS'] lists {', '.join(sensitive)}, "
                "which are never stored.",
                hint="Remove them: replaying cookies or credentials would leak them.",
                id=W002,
            )
        ]
    return []


def _check_middleware(paths: Any, methods: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    bad_paths = isinstance(paths, str) or not isinstance(paths, Iterable)
    if not bad_paths:
        for pattern in paths:
            try:
                re.compile(pattern)
            except (re.error, TypeError):
                bad_paths = True
    if bad_paths:
        errors.append(
            Error(
                "IDEMPOTENCY['MIDDLEWARE_PATHS'] must be a list of regular expressions.",
                hint=r"For example [r'^/api/payments/'].",
                id=E010,
            )
        )
    if (
        isinstance(methods, str)
        or not isinstance(methods, Iterable)
        or not all(isinstance(method, str) and _TOKEN.match(method) for method in methods)
    ):
        errors.append(
            Error(
                "IDEMPOTENCY['MIDDLEWARE_METHODS'] must be a list of HTTP methods.",
                hint="For example ['POST', 'PATCH'].",
                id=E012,
            )
        )
    return errors


@register(Tags.database)
def check_sqlite(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """SQLite needs IMMEDIATE transactions, or concurrent writers fail with 'database is locked'."""
    if settings.DEBUG:
        return []
    from django.db import connections

    warnings: list[CheckMessage] = []
    for alias in kwargs.get("databases") or ():
        settings_dict = connections.settings[alias]
        if "sqlite3" not in settings_dict["ENGINE"]:
            continue
        mode = str(settings_dict.get("OPTIONS", {}).get("transaction_mode") or "").upper()
        if mode != "IMMEDIATE":
            warnings.append(
                Warning(
                    f"Database {alias!r} is SQLite without IMMEDIATE transactions.",
                    hint=(
                        "Set DATABASES[...]['OPTIONS'] = {'transaction_mode': 'IMMEDIATE', "
                        "'timeout': 20}, or use PostgreSQL in production."
                    ),
                    id=W003,
                )
            )
    return warnings


@register(Tags.compatibility)
def check_middleware_order(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    middleware = list(getattr(settings, "MIDDLEWARE", []))
    ours = "django_idempotency.middleware.IdempotencyMiddleware"
    auth = "django.contrib.auth.middleware.AuthenticationMiddleware"
    if (
        ours in middleware
        and auth in middleware
        and middleware.index(ours) < middleware.index(auth)
    ):
        return [
            Warning(
                "IdempotencyMiddleware comes before AuthenticationMiddleware.",
                hint="Move it after AuthenticationMiddleware so keys are scoped by user.",
                id=W004,
            )
        ]
    return []


_DJANGO_REDIS_BACKEND = "django_redis.cache.RedisCache"


@register(Tags.caches)
def check_fast_path(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The Redis fast path needs a django-redis cache that fails fast when Redis hangs."""
    user = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user, dict):
        return []  # E001 already says IDEMPOTENCY is not a dict
    retry = user.get("CACHE_RETRY_SECONDS", DEFAULTS["CACHE_RETRY_SECONDS"])
    if not _is_number(retry) or retry < 0:
        return [
            Error(
                f"IDEMPOTENCY['CACHE_RETRY_SECONDS'] must be a number of seconds >= 0, "
                f"not {retry!r}.",
                hint="0 retries Redis on every request; the default is 5.",
                id=E042,
            )
        ]
    alias = user.get("CACHE_ALIAS")
    if alias is None:
        return []
    caches_setting = getattr(settings, "CACHES", {})
    if not isinstance(alias, str) or alias not in caches_setting:
        return [
            Error(
                f"IDEMPOTENCY['CACHE_ALIAS'] = {alias!r} is not an alias in CACHES.",
                hint="Name a django-redis cache from CACHES, or set it to None for the "
                "database only.",
                id=E040,
            )
        ]
    cache = caches_setting[alias]
    if cache.get("BACKEND") != _DJANGO_REDIS_BACKEND:
        return [
            Error(
                f"CACHES[{alias!r}] (IDEMPOTENCY['CACHE_ALIAS']) uses {cache.get('BACKEND')!r}; "
                f"the fast path needs {_DJANGO_REDIS_BACKEND!r}.",
                hint="pip install 'django-idempotency[redis]' and set that BACKEND.",
                id=E041,
            )
        ]
    options = cache.get("OPTIONS") or {}
    if not options.get("SOCKET_TIMEOUT") or not options.get("SOCKET_CONNECT_TIMEOUT"):
        return [
            Warning(
                f"CACHES[{alias!r}] (IDEMPOTENCY['CACHE_ALIAS']) sets no SOCKET_TIMEOUT or "
                "SOCKET_CONNECT_TIMEOUT: a Redis that hangs would hang every idempotent request.",
                hint="Set OPTIONS = {'SOCKET_CONNECT_TIMEOUT': 0.1, 'SOCKET_TIMEOUT': 0.1}; "
                "on a timeout the request falls back to the database.",
                id=W040,
            )
        ]
    return []


#: Operations settings: (name, module it needs or None, warning id, extra that installs it).
_OPERATIONS_SETTINGS = (
    ("REGISTER_ADMIN", None, None, None),
    ("METRICS", "prometheus_client", W060, "metrics"),
    ("TRACING", "opentelemetry.trace", W061, "otel"),
)


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


@register(Tags.compatibility)
def check_operations(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    user = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user, dict):
        return []  # E001 already says so
    messages: list[CheckMessage] = []
    for name, module, warning_id, extra in _OPERATIONS_SETTINGS:
        value = user.get(name, DEFAULTS[name])
        if not isinstance(value, bool):
            messages.append(
                Error(f"IDEMPOTENCY[{name!r}] must be True or False, not {value!r}.", id=E060)
            )
        elif module and warning_id and user.get(name) is True and not importable(module):
            messages.append(
                Warning(
                    f"IDEMPOTENCY[{name!r}] is True but {module.split('.')[0]} is not installed, "
                    "so it has no effect.",
                    hint=f"pip install 'django-idempotency[{extra}]', or remove the setting.",
                    id=warning_id,
                )
            )
    return messages


# --- Layers 2 and 3: outbox, consumers, sweeps -----------------------------------------------

E020 = "django_idempotency.E020"  # OUTBOX_PUBLISHERS not a dict of pattern -> publisher spec
E021 = "django_idempotency.E021"  # a publisher backend does not import or is not a Publisher
E022 = "django_idempotency.E022"  # a count setting is not a positive integer
E023 = "django_idempotency.E023"  # a duration setting is not a positive number
E024 = "django_idempotency.E024"  # OUTBOX_BACKOFF_MAX_SECONDS below OUTBOX_BACKOFF_BASE_SECONDS
E025 = "django_idempotency.E025"  # OUTBOX_KICK does not import or is not callable
E026 = "django_idempotency.E026"  # an outbox boolean setting is not a bool
W020 = "django_idempotency.W020"  # INBOX_RETENTION shorter than the redelivery horizon
W021 = "django_idempotency.W021"  # an idempotent consumer task without acks_late
W022 = "django_idempotency.W022"  # database without SELECT ... FOR UPDATE SKIP LOCKED
W023 = "django_idempotency.W023"  # an idempotent consumer task without reject_on_worker_lost

_OUTBOX_COUNTS = ("OUTBOX_BATCH_SIZE", "OUTBOX_MAX_ATTEMPTS", "SWEEP_BATCH_SIZE")
_OUTBOX_DURATIONS = (
    "OUTBOX_RELAY_LEASE_SECONDS",
    "OUTBOX_BACKOFF_BASE_SECONDS",
    "OUTBOX_BACKOFF_MAX_SECONDS",
    "OUTBOX_POLL_SECONDS",
    "OUTBOX_RETENTION_SECONDS",
    "INBOX_RETENTION_SECONDS",
)
_OUTBOX_BOOLEANS = ("OUTBOX_REQUIRE_ATOMIC", "OUTBOX_NOTIFY")
#: Redis and SQS redeliver an unacknowledged message after this long (their default).
_DEFAULT_VISIBILITY_TIMEOUT = 3600


def _merged() -> dict[str, Any] | None:
    user = getattr(settings, "IDEMPOTENCY", {})
    return {**DEFAULTS, **user} if isinstance(user, dict) else None


@register(Tags.compatibility)
def check_outbox_settings(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    merged = _merged()
    if merged is None:
        return []  # E001 already says IDEMPOTENCY is not a dict
    errors = _check_publishers(merged["OUTBOX_PUBLISHERS"])
    for name in _OUTBOX_COUNTS:
        if not _is_int(merged[name]) or merged[name] <= 0:
            errors.append(
                Error(
                    f"IDEMPOTENCY[{name!r}] must be a positive integer, not {merged[name]!r}.",
                    hint=f"Remove it to use the default, {DEFAULTS[name]!r}.",
                    id=E022,
                )
            )
    for name in _OUTBOX_DURATIONS:
        if not _is_number(merged[name]) or merged[name] <= 0:
            errors.append(
                Error(
                    f"IDEMPOTENCY[{name!r}] must be a positive number of seconds, "
                    f"not {merged[name]!r}.",
                    hint=f"Remove it to use the default, {DEFAULTS[name]!r}.",
                    id=E023,
                )
            )
    base, cap = merged["OUTBOX_BACKOFF_BASE_SECONDS"], merged["OUTBOX_BACKOFF_MAX_SECONDS"]
    if _is_number(base) and _is_number(cap) and 0 < cap < base:
        errors.append(
            Error(
                f"IDEMPOTENCY['OUTBOX_BACKOFF_MAX_SECONDS'] ({cap}) is below "
                f"OUTBOX_BACKOFF_BASE_SECONDS ({base}).",
                hint="The cap must be at least the first delay.",
                id=E024,
            )
        )
    errors += _check_kick(merged["OUTBOX_KICK"])
    for name in _OUTBOX_BOOLEANS:
        if not isinstance(merged[name], bool):
            errors.append(
                Error(f"IDEMPOTENCY[{name!r}] must be True or False.", hint=None, id=E026)
            )
    return errors


def _check_publishers(routes: Any) -> list[CheckMessage]:
    from django_idempotency.publishers.base import Publisher
    from django_idempotency.publishers.routing import parse_spec

    if not isinstance(routes, dict) or not all(isinstance(name, str) for name in routes):
        return [
            Error(
                "IDEMPOTENCY['OUTBOX_PUBLISHERS'] must be a dict of topic pattern -> publisher.",
                hint="For example {'*': 'django_idempotency.publishers.celery.CeleryPublisher'}.",
                id=E020,
            )
        ]
    errors: list[CheckMessage] = []
    for pattern, spec in routes.items():
        try:
            route = parse_spec(pattern, spec)
        except ImproperlyConfigured as exc:
            errors.append(Error(str(exc), hint="See docs/outbox.md, 'Publishers'.", id=E020))
            continue
        try:
            backend = import_string(route.backend)
        except ImportError as exc:
            errors.append(
                Error(
                    f"IDEMPOTENCY['OUTBOX_PUBLISHERS'][{pattern!r}] = {route.backend!r} does "
                    f"not import: {exc}.",
                    hint="Install the publisher's extra (celery, amqp, webhook) or fix the path.",
                    id=E021,
                )
            )
            continue
        if not (isinstance(backend, type) and issubclass(backend, Publisher)):
            errors.append(
                Error(
                    f"IDEMPOTENCY['OUTBOX_PUBLISHERS'][{pattern!r}] = {route.backend!r} is not "
                    "a Publisher subclass.",
                    hint="Subclass django_idempotency.publishers.Publisher.",
                    id=E021,
                )
            )
    return errors


def _check_kick(value: Any) -> list[CheckMessage]:
    if value is None:
        return []
    try:
        kick = import_string(value) if isinstance(value, str) else value
    except ImportError as exc:
        kick, problem = None, f"does not import: {exc}"
    else:
        problem = "is not callable"
    if callable(kick):
        return []
    return [
        Error(
            f"IDEMPOTENCY['OUTBOX_KICK'] = {value!r} {problem}.",
            hint="Use the dotted path of a callable taking the database alias, or None.",
            id=E025,
        )
    ]


@register(Tags.compatibility)
def check_consumers(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Idempotent Celery tasks: acks_late, and markers kept as long as a redelivery can come.

    Reads the current Celery app, the one ``manage.py`` and the worker load from the project.
    """
    merged = _merged()
    try:
        from celery import current_app
    except ImportError:  # pragma: no cover - exercised only without Celery installed
        return []
    if merged is None:
        return []
    try:
        registered = list(current_app.tasks.values())
    except RuntimeError:  # an app with autofinalize=False, not finalized yet
        registered = []
    tasks = [
        task
        for task in registered
        if getattr(getattr(task, "run", None), "__idempotent_consumer__", False)
    ]
    warnings: list[CheckMessage] = []
    for task in tasks:
        if not task.acks_late:
            warnings.append(
                Warning(
                    f"Idempotent consumer task {task.name!r} runs without acks_late.",
                    hint=(
                        "Use @shared_task(acks_late=True) (or task_acks_late = True): "
                        "otherwise a worker that dies mid-task has already acknowledged the "
                        "message and it is lost, not redelivered."
                    ),
                    id=W021,
                )
            )
        elif not task.reject_on_worker_lost:
            warnings.append(
                Warning(
                    f"Idempotent consumer task {task.name!r} runs without reject_on_worker_lost.",
                    hint=(
                        "Use @shared_task(acks_late=True, reject_on_worker_lost=True) (or "
                        "task_reject_on_worker_lost = True): with the prefork pool, Celery "
                        "acknowledges the message of a pool process that died mid-task, and it "
                        "is lost. Silence this only for a worker pool that is not prefork."
                    ),
                    id=W023,
                )
            )
    horizon, source = _redelivery_horizon(current_app, tasks, merged)
    retention = merged["INBOX_RETENTION_SECONDS"]
    if _is_number(retention) and retention < horizon:
        warnings.append(
            Warning(
                f"IDEMPOTENCY['INBOX_RETENTION_SECONDS'] ({retention}) is shorter than "
                f"{source} ({horizon:g} s).",
                hint=(
                    "A message redelivered after its marker was swept runs again. Keep "
                    "INBOX_RETENTION_SECONDS above the longest time a message can come back."
                ),
                id=W020,
            )
        )
    return warnings


def _redelivery_horizon(app: Any, tasks: list[Any], merged: dict[str, Any]) -> tuple[float, str]:
    """The longest a message may come back after it was first handled, and what sets it."""
    candidates: list[tuple[float, str]] = [(0.0, "")]
    options = app.conf.broker_transport_options or {}
    broker = str(app.conf.broker_url or "")
    timeout: Any = options.get("visibility_timeout")
    if timeout is None and broker.split("://")[0] in ("redis", "rediss", "sqs"):
        timeout = _DEFAULT_VISIBILITY_TIMEOUT
    if _is_number(timeout):
        candidates.append((float(timeout), "the broker's visibility_timeout"))
    for task in tasks:
        retries = task.max_retries or 0
        delay = task.default_retry_delay or 0
        candidates.append((float(retries * delay), f"the retry span of {task.name!r}"))
    base, cap, attempts = (
        merged["OUTBOX_BACKOFF_BASE_SECONDS"],
        merged["OUTBOX_BACKOFF_MAX_SECONDS"],
        merged["OUTBOX_MAX_ATTEMPTS"],
    )
    if _is_number(base) and _is_number(cap) and _is_int(attempts):
        span = sum(min(cap, base * 2 ** min(n, 62)) for n in range(max(attempts - 1, 0)))
        candidates.append((float(span), "the outbox's retry span (OUTBOX_BACKOFF_*)"))
    return max(candidates)


@register(Tags.database)
def check_skip_locked(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Without SKIP LOCKED, relays running side by side queue on each other's rows."""
    from django.db import connections, router

    from django_idempotency.models import OutboxEvent

    alias = router.db_for_write(OutboxEvent)
    if alias not in (kwargs.get("databases") or ()):
        return []
    features = connections[alias].features
    if features.has_select_for_update_skip_locked or not features.has_select_for_update:
        return []
    return [
        Warning(
            f"Database {alias!r} has no SELECT ... FOR UPDATE SKIP LOCKED.",
            hint=(
                "Outbox relays stay correct but wait on each other; run one relay, or use "
                "PostgreSQL, MariaDB 10.6+ or MySQL 8."
            ),
            id=W022,
        )
    ]
