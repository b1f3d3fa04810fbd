"""System checks, declared as a table: one :class:`Check` row per id.

Each row holds its id, the condition that finds the problem, the message and the hint. The ids
are stable and never reused once retired; ``docs/checks.md`` documents each one with its fix.
:func:`register_all` hands every row to Django's check framework from ``AppConfig.ready()``, so
``manage.py check`` (and ``runserver``, ``migrate``, the test runner) runs them with their tags.

A condition yields one mapping per problem it finds; the row formats its message and hint with
it. A condition never connects to a database unless its row is tagged ``database`` (Django then
runs it only for ``check --database`` and ``migrate``), and never prints a publisher option's
value: options hold signing secrets and broker passwords.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.utils.module_loading import import_string

from django_idempotency.conf import (
    BOOLEAN_MESSAGE,
    CREDENTIAL_SCOPE_MESSAGE,
    DEFAULTS,
    HEADER_NAMES_MESSAGE,
    SENSITIVE_HEADERS,
    parse_bool,
    parse_credential_scope,
    parse_int,
    parse_number,
)
from django_idempotency.exceptions import IdempotencyConfigurationError

__all__ = [
    "BY_ID",
    "CHECKS",
    "Check",
    "DEPLOY_CHECKS",
    "Context",
    "E001",
    "E002",
    "E003",
    "E004",
    "E005",
    "E006",
    "E007",
    "E008",
    "E009",
    "E010",
    "E011",
    "E012",
    "E013",
    "E014",
    "E015",
    "E016",
    "E017",
    "E018",
    "E020",
    "E021",
    "E022",
    "E023",
    "E024",
    "E025",
    "E026",
    "E027",
    "E028",
    "E040",
    "E041",
    "E042",
    "E043",
    "E044",
    "E060",
    "E080",
    "E081",
    "E082",
    "E083",
    "E084",
    "FAST_PATH_CHECKS",
    "Finding",
    "MIDDLEWARE",
    "OPERATIONS_CHECKS",
    "OUTBOX_CHECKS",
    "PROJECT_CHECKS",
    "RETRY_WINDOW_SECONDS",
    "SETTINGS_CHECKS",
    "STORAGE_CHECKS",
    "W001",
    "W002",
    "W003",
    "W004",
    "W005",
    "W006",
    "W007",
    "W008",
    "W009",
    "W010",
    "W020",
    "W021",
    "W022",
    "W023",
    "W024",
    "W025",
    "W026",
    "W011",
    "W027",
    "W040",
    "W041",
    "W060",
    "W061",
    "W062",
    "W080",
    "W081",
    "check_settings",
    "importable",
    "register_all",
]

# Layer 1: request settings, middleware and databases
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
E011 = "django_idempotency.E011"  # KEY_REQUIRED, LEASE_HEARTBEAT or LOG_KEYS is not a boolean
E012 = "django_idempotency.E012"  # MIDDLEWARE_METHODS not HTTP methods
E013 = "django_idempotency.E013"  # a middleware after IdempotencyMiddleware has process_view
E014 = "django_idempotency.E014"  # CREDENTIAL_SCOPE is neither "digest" nor "refuse"
E015 = "django_idempotency.E015"  # CREDENTIAL_HEADERS is not a list of header names
E016 = "django_idempotency.E016"  # an ATTACH_*_WAIT_SECONDS setting is not a number >= 0
E017 = "django_idempotency.E017"  # ATTACH_MAX_WAITERS(_PER_SCOPE) is not an integer >= 0
E018 = "django_idempotency.E018"  # ATTACH_POLL_SECONDS is not a positive number
E019 = "django_idempotency.E019"  # HANDOFF_HOLD_SECONDS is not a positive number
W001 = "django_idempotency.W001"  # unknown key in IDEMPOTENCY
W002 = "django_idempotency.W002"  # STORED_RESPONSE_HEADERS lists a header never stored
W003 = "django_idempotency.W003"  # SQLite without IMMEDIATE transactions
W004 = "django_idempotency.W004"  # middleware placed before AuthenticationMiddleware
W005 = "django_idempotency.W005"  # IdempotencyRecord routed to a database other than "default"
W006 = "django_idempotency.W006"  # USE_TZ = False
W007 = "django_idempotency.W007"  # middleware paths behind DRF token/JWT/Basic authentication
W008 = "django_idempotency.W008"  # deploy: guarded views share the anonymous scope
W009 = "django_idempotency.W009"  # deploy: session features behind a transaction-mode pooler
W010 = "django_idempotency.W010"  # deploy: TTL_SECONDS shorter than clients retry (a day)
W011 = "django_idempotency.W011"  # one scope's waiting duplicates could hold every server thread
# Layers 2 and 3: outbox, consumers, sweeps
E020 = "django_idempotency.E020"  # OUTBOX_PUBLISHERS not a dict of pattern -> publisher spec
E021 = "django_idempotency.E021"  # a publisher backend does not import or is not a Publisher
E022 = "django_idempotency.E022"  # a count setting is not a positive integer
E023 = "django_idempotency.E023"  # a duration setting is not a positive number
E024 = "django_idempotency.E024"  # OUTBOX_BACKOFF_MAX_SECONDS below OUTBOX_BACKOFF_BASE_SECONDS
E025 = "django_idempotency.E025"  # OUTBOX_KICK does not import or is not callable
E026 = "django_idempotency.E026"  # OUTBOX_REQUIRE_ATOMIC or OUTBOX_NOTIFY is not a boolean
E027 = "django_idempotency.E027"  # OUTBOX_KICK set while OUTBOX_PUBLISHERS is empty
E028 = "django_idempotency.E028"  # a route's OPTIONS do not fit its publisher's arguments
W020 = "django_idempotency.W020"  # INBOX_RETENTION shorter than the redelivery horizon
W021 = "django_idempotency.W021"  # an idempotent consumer task without acks_late
W022 = "django_idempotency.W022"  # database without SELECT ... FOR UPDATE SKIP LOCKED
W023 = "django_idempotency.W023"  # an idempotent consumer task without reject_on_worker_lost
W024 = "django_idempotency.W024"  # OUTBOX_PUBLISHERS has no catch-all ("*") route
W025 = "django_idempotency.W025"  # the default OUTBOX_KICK without Celery relays in-process
W026 = "django_idempotency.W026"  # a NATS duplicate window shorter than the retry horizon
W027 = "django_idempotency.W027"  # deploy: the outbox's Celery broker is Redis without timeouts
# Fast paths: the Redis copy, and answers kept in memory
E040 = "django_idempotency.E040"  # CACHE_ALIAS is not None or a configured cache alias
E041 = "django_idempotency.E041"  # CACHE_ALIAS names a cache that is not django-redis
E042 = "django_idempotency.E042"  # CACHE_RETRY_SECONDS is not a number >= 0
E043 = "django_idempotency.E043"  # LOCAL_REPLAY_SECONDS is not a number >= 0
E044 = "django_idempotency.E044"  # LOCAL_REPLAY_ENTRIES is not a positive integer
W040 = "django_idempotency.W040"  # the CACHE_ALIAS cache has no socket timeouts
W041 = "django_idempotency.W041"  # deploy: LOCAL_REPLAY_SECONDS on, and several processes run
# Operations
E060 = "django_idempotency.E060"  # REGISTER_ADMIN, METRICS or TRACING is not a boolean
W060 = "django_idempotency.W060"  # METRICS set to True but prometheus_client is not installed
W061 = "django_idempotency.W061"  # TRACING set to True but opentelemetry-api is not installed
W062 = "django_idempotency.W062"  # deploy: the sweeps are not scheduled (or have not run)
# Storage at scale: the partitioned records, outbox and inbox tables (E082-W081: any of them)
E080 = "django_idempotency.E080"  # RECORD_/OUTBOX_/INBOX_PARTITIONS is not a boolean
E081 = "django_idempotency.E081"  # PARTITION_SPAN_DAYS or PARTITION_AHEAD_DAYS not a positive int
E082 = "django_idempotency.E082"  # RECORD_PARTITIONS on, the records database is not PostgreSQL
E083 = "django_idempotency.E083"  # the records table is partitioned, RECORD_PARTITIONS is off
E084 = "django_idempotency.E084"  # the app's tables are missing or its migrations unapplied
W080 = "django_idempotency.W080"  # RECORD_PARTITIONS on, the records table is still plain
W081 = "django_idempotency.W081"  # the next partition of the records table does not exist yet

MIDDLEWARE = "django_idempotency.request.middleware.IdempotencyMiddleware"
_AUTHENTICATION_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
_DJANGO_REDIS_BACKEND = "django_redis.cache.RedisCache"
_SESSION_AUTHENTICATION = "rest_framework.authentication.SessionAuthentication"
#: The default resolver.
_DEFAULT_RESOLVERS = frozenset({DEFAULTS["SCOPE_RESOLVER"]})
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
#: Redis and SQS redeliver an unacknowledged message after this long (their default).
_DEFAULT_VISIBILITY_TIMEOUT = 3600
_APP_LABEL = "django_idempotency"

Finding = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Context:
    """What conditions read: ``IDEMPOTENCY`` as given, merged over the defaults, and the
    databases Django asked to check (``None`` unless ``check --database`` or ``migrate``)."""

    user: Mapping[str, Any]
    merged: Mapping[str, Any]
    valid: bool
    databases: Sequence[str] | None

    @classmethod
    def load(cls, databases: Sequence[str] | None) -> Context:
        raw = getattr(settings, "IDEMPOTENCY", {})
        user = raw if isinstance(raw, dict) else {}
        return cls(user, {**DEFAULTS, **user}, isinstance(raw, dict), databases)


@dataclass(eq=False)
class Check:
    """One system check: an Error when its id says ``E``, a Warning when ``W``.

    Registered with Django as a check function (instances are callable), so ``tags`` is also
    the attribute Django's registry sets.
    """

    id: str
    condition: Callable[[Context], Iterable[Finding]]
    message: str
    hint: str | None = None
    tags: tuple[str, ...] = (Tags.compatibility,)
    #: False for checks that do not read ``IDEMPOTENCY``; the others wait for E001 to pass.
    reads_settings: bool = True
    #: Run only by ``check --deploy``: what is fine on a laptop and wrong in production.
    deploy: bool = False

    def __call__(
        self,
        app_configs: Sequence[Any] | None = None,
        databases: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> list[CheckMessage]:
        context = Context.load(databases)
        if self.reads_settings and not context.valid:
            return []
        level = Error if self.id.rpartition(".")[2].startswith("E") else Warning
        return [
            level(
                self.message.format(**found),
                hint=None if self.hint is None else self.hint.format(**found),
                id=self.id,
            )
            for found in self.condition(context)
        ]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(name: str, merged: Mapping[str, Any]) -> float | None:
    try:
        return parse_number(name, merged[name])
    except IdempotencyConfigurationError:
        return None


def _integer(name: str, merged: Mapping[str, Any]) -> int | None:
    try:
        return parse_int(name, merged[name])
    except IdempotencyConfigurationError:
        return None


def _shown(value: Any, number: float | None) -> str:
    """A value for a message: numbers as they are, anything else by its type only."""
    return repr(value) if number is not None else f"a {type(value).__name__}"


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _middleware() -> list[str]:
    return [str(path) for path in getattr(settings, "MIDDLEWARE", None) or []]


# --- conditions: Layer 1 settings -------------------------------------------------------------


def _not_a_dict(c: Context) -> Iterator[Finding]:
    if not c.valid:
        yield {}


def _unknown_keys(c: Context) -> Iterator[Finding]:
    for name in sorted(set(c.user) - set(DEFAULTS), key=str):
        yield {"name": name}


def _bad_numbers(
    *names: str, whole: bool = False, zero: bool = False
) -> Callable[[Context], Iterator[Finding]]:
    """Settings that are not numbers (``whole``: integers) above zero (``zero``: or equal)."""
    parse = _integer if whole else _number

    def condition(c: Context) -> Iterator[Finding]:
        for name in names:
            number = parse(name, c.merged)
            if number is None or number < 0 or (number == 0 and not zero):
                yield {
                    "name": name,
                    "value": _shown(c.merged[name], number),
                    "default": DEFAULTS[name],
                }

    return condition


def _not_booleans(*names: str) -> Callable[[Context], Iterator[Finding]]:
    def condition(c: Context) -> Iterator[Finding]:
        for name in names:
            try:
                parse_bool(name, c.merged[name])
            except IdempotencyConfigurationError:
                yield {"name": name, "kind": type(c.merged[name]).__name__}

    return condition


def _ttl_below_lease(c: Context) -> Iterator[Finding]:
    lease, ttl = _number("LEASE_SECONDS", c.merged), _number("TTL_SECONDS", c.merged)
    if lease is not None and ttl is not None and 0 < ttl < lease:
        yield {"ttl": c.merged["TTL_SECONDS"], "lease": c.merged["LEASE_SECONDS"]}


def _importable_callable(
    name: str, *, optional: bool = False
) -> Callable[[Context], Iterator[Finding]]:
    def condition(c: Context) -> Iterator[Finding]:
        value = c.merged[name]
        if value is None and optional:
            return
        try:
            found = import_string(value) if isinstance(value, str) else value
        except ImportError as exc:
            yield {"value": value, "problem": f"does not import: {exc}"}
            return
        if not callable(found):
            yield {"value": value, "problem": "is not callable"}

    return condition


def _not_status_codes(c: Context) -> Iterator[Finding]:
    value = c.merged["STORED_STATUS_CODES"]
    valid = isinstance(value, Iterable) and not isinstance(value, str | bytes)
    if valid:
        codes = list(value)
        valid = bool(codes) and all(
            isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599
            for code in codes
        )
    if not valid:
        yield {}


def _header_list(value: Any) -> list[str] | None:
    """The names, when ``value`` is a list of valid header names; None otherwise."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        return None
    names = list(value)
    if all(isinstance(name, str) and _TOKEN.match(name) for name in names):
        return names
    return None


def _not_header_names(c: Context) -> Iterator[Finding]:
    if _header_list(c.merged["STORED_RESPONSE_HEADERS"]) is None:
        yield {}


def _never_stored_headers(c: Context) -> Iterator[Finding]:
    names = _header_list(c.merged["STORED_RESPONSE_HEADERS"]) or []
    sensitive = sorted(name for name in names if name.lower() in SENSITIVE_HEADERS)
    if sensitive:
        yield {"names": ", ".join(sensitive)}


def _bad_header_settings(c: Context) -> Iterator[Finding]:
    for name in ("HEADER", "REPLAY_HEADER"):
        value = c.merged[name]
        if not isinstance(value, str) or not _TOKEN.match(value):
            yield {"name": name, "value": value}


def _bad_middleware_paths(c: Context) -> Iterator[Finding]:
    paths = c.merged["MIDDLEWARE_PATHS"]
    if isinstance(paths, str) or not isinstance(paths, Iterable):
        yield {}
        return
    for pattern in paths:
        try:
            re.compile(pattern)
        except (re.error, TypeError):
            yield {}
            return


def _bad_middleware_methods(c: Context) -> Iterator[Finding]:
    methods = c.merged["MIDDLEWARE_METHODS"]
    if (
        isinstance(methods, str)
        or not isinstance(methods, Iterable)
        or not all(isinstance(method, str) and _TOKEN.match(method) for method in methods)
    ):
        yield {}


def _bad_credential_scope(c: Context) -> Iterator[Finding]:
    try:
        parse_credential_scope(c.merged["CREDENTIAL_SCOPE"])
    except IdempotencyConfigurationError:
        yield {"kind": type(c.merged["CREDENTIAL_SCOPE"]).__name__}


def _bad_credential_headers(c: Context) -> Iterator[Finding]:
    value = c.merged["CREDENTIAL_HEADERS"]
    if not isinstance(value, list | tuple) or _header_list(value) is None:
        yield {"name": "CREDENTIAL_HEADERS", "kind": type(value).__name__}


# --- conditions: the project around the app --------------------------------------------------


def _view_middleware_after_ours(c: Context) -> Iterator[Finding]:
    middleware = _middleware()
    if MIDDLEWARE not in middleware:
        return
    for path in middleware[middleware.index(MIDDLEWARE) + 1 :]:
        try:
            found = import_string(path)
        except Exception:  # a path that does not import is Django's own error to report
            continue
        if callable(getattr(found, "process_view", None)):
            yield {"path": path}


def _before_authentication(c: Context) -> Iterator[Finding]:
    middleware = _middleware()
    if (
        MIDDLEWARE in middleware
        and _AUTHENTICATION_MIDDLEWARE in middleware
        and middleware.index(MIDDLEWARE) < middleware.index(_AUTHENTICATION_MIDDLEWARE)
    ):
        yield {}


def _sqlite_without_immediate(c: Context) -> Iterator[Finding]:
    """Reads each alias's ENGINE and OPTIONS; loading a backend module does not connect."""
    from django.db import connections
    from django.db.utils import load_backend

    for alias, settings_dict in connections.settings.items():
        try:
            vendor = load_backend(settings_dict["ENGINE"]).DatabaseWrapper.vendor
        except Exception:  # an ENGINE that does not load is Django's own error to report
            continue
        options = settings_dict.get("OPTIONS") or {}
        mode = str(options.get("transaction_mode") or "").upper()
        if vendor == "sqlite" and mode != "IMMEDIATE":
            yield {"alias": alias}


def _records_routed_away(c: Context) -> Iterator[Finding]:
    from django.db import DEFAULT_DB_ALIAS, connections, router

    from django_idempotency.models import IdempotencyRecord

    alias = router.db_for_write(IdempotencyRecord)
    if alias != DEFAULT_DB_ALIAS and DEFAULT_DB_ALIAS in connections.settings:
        yield {"alias": alias}


def _naive_datetimes(c: Context) -> Iterator[Finding]:
    if not settings.USE_TZ:
        yield {}


def _is_default_resolver(value: Any) -> bool:
    if isinstance(value, str):
        return value in _DEFAULT_RESOLVERS
    path = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return path in _DEFAULT_RESOLVERS


def _drf_credential_classes() -> list[str]:
    """DRF's authentication classes (its defaults applied) that are not session based."""
    if not importable("rest_framework"):
        return []
    try:
        from rest_framework.authentication import SessionAuthentication
        from rest_framework.settings import api_settings

        classes: list[Any] = list(api_settings.DEFAULT_AUTHENTICATION_CLASSES)
    except ImportError:  # a class that does not import is DRF's own error to report
        return []
    return [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if not (isinstance(cls, type) and issubclass(cls, SessionAuthentication))
    ]


def server_threads() -> tuple[int, str] | None:
    """The threads per process of the WSGI server, where they can be known: gunicorn's, from
    ``GUNICORN_CMD_ARGS`` as gunicorn reads it (sync and gthread workers; an async worker's
    waiters hold no thread). None elsewhere."""
    if not os.environ.get("GUNICORN_CMD_ARGS"):
        return None
    try:
        from gunicorn.config import Config
    except ImportError:
        return None
    config = Config()
    try:
        parsed = config.parser().parse_args(config.get_cmd_args_from_env())
    except SystemExit:  # arguments gunicorn itself would refuse
        return None
    for name, value in vars(parsed).items():
        if value is not None and name != "args":
            config.set(name.lower(), value)
    if config.worker_class_str not in ("sync", "gthread"):
        return None
    return max(1, int(config.threads)), "GUNICORN_CMD_ARGS"


def _waiters_hold_every_thread(c: Context) -> Iterator[Finding]:
    per_scope = _integer("ATTACH_MAX_WAITERS_PER_SCOPE", c.merged)
    known = server_threads()
    if per_scope is None or known is None:
        return
    threads, source = known
    if per_scope >= threads:
        yield {"per_scope": per_scope, "threads": threads, "source": source}


def _credentials_behind_middleware(c: Context) -> Iterator[Finding]:
    try:
        scope = parse_credential_scope(c.merged["CREDENTIAL_SCOPE"])
    except IdempotencyConfigurationError:
        return  # E014 says so
    if (
        MIDDLEWARE in _middleware()
        and c.merged["MIDDLEWARE_PATHS"]
        and _is_default_resolver(c.merged["SCOPE_RESOLVER"])
        and scope == "digest"
    ):
        classes = _drf_credential_classes()
        if classes:
            yield {"classes": ", ".join(classes)}


# --- conditions: outbox and consumers ----------------------------------------------------------


def _routes(c: Context) -> dict[str, Any] | None:
    """OUTBOX_PUBLISHERS when it is a dict keyed by patterns (else E020 says what is wrong)."""
    routes = c.merged["OUTBOX_PUBLISHERS"]
    if isinstance(routes, dict) and all(isinstance(pattern, str) for pattern in routes):
        return routes
    return None


def _bad_routes(c: Context) -> Iterator[Finding]:
    from django_idempotency.publishers.routing import SETTING, route_setting, spec_problem

    routes = _routes(c)
    if routes is None:
        yield {
            "where": SETTING,
            "problem": "must be a dict of topic pattern -> dotted path or "
            "{'BACKEND': 'dotted.path', 'OPTIONS': {...}}",
        }
        return
    for pattern, spec in routes.items():
        problem = spec_problem(spec)
        if problem is not None:
            yield {"where": route_setting(pattern), "problem": problem}


def _publisher_classes(c: Context) -> Iterator[tuple[str, Any, Any]]:
    """(pattern, route, the imported backend or the ImportError) for each well-formed route."""
    from django_idempotency.publishers.routing import parse_spec, spec_problem

    for pattern, spec in (_routes(c) or {}).items():
        if spec_problem(spec) is not None:
            continue
        route = parse_spec(pattern, spec)
        try:
            backend: Any = import_string(route.backend)
        except ImportError as exc:
            backend = exc
        yield pattern, route, backend


def _bad_publishers(c: Context) -> Iterator[Finding]:
    from django_idempotency.publishers.base import Publisher
    from django_idempotency.publishers.routing import route_setting

    for pattern, route, backend in _publisher_classes(c):
        if isinstance(backend, ImportError):
            problem = f"does not import: {backend}"
        elif not (isinstance(backend, type) and issubclass(backend, Publisher)):
            problem = "is not a Publisher subclass"
        else:
            continue
        yield {"where": route_setting(pattern), "backend": route.backend, "problem": problem}


def _options_refused(c: Context) -> Iterator[Finding]:
    from django_idempotency.publishers.base import Publisher
    from django_idempotency.publishers.routing import options_problem, route_setting

    for pattern, route, backend in _publisher_classes(c):
        if isinstance(backend, type) and issubclass(backend, Publisher):
            problem = options_problem(backend, route.options)
            if problem is not None:
                yield {
                    "where": route_setting(pattern),
                    "publisher": backend.__name__,
                    "problem": problem,
                }


def _no_catch_all(c: Context) -> Iterator[Finding]:
    routes = _routes(c)
    if routes is None or any(pattern and not pattern.strip("*") for pattern in routes):
        return
    patterns = ", ".join(repr(pattern) for pattern in routes)
    yield {"routed": f"only {patterns}" if patterns else "none"}


def _kick_without_publishers(c: Context) -> Iterator[Finding]:
    if c.user.get("OUTBOX_KICK") is not None and _routes(c) == {}:
        yield {}


def _kick_without_celery(c: Context) -> Iterator[Finding]:
    if (
        c.merged["OUTBOX_KICK"] == DEFAULTS["OUTBOX_KICK"]
        and _routes(c)
        and not importable("celery")
    ):
        yield {}


def _backoff_cap_below_base(c: Context) -> Iterator[Finding]:
    base = _number("OUTBOX_BACKOFF_BASE_SECONDS", c.merged)
    cap = _number("OUTBOX_BACKOFF_MAX_SECONDS", c.merged)
    if base is not None and cap is not None and 0 < cap < base:
        yield {
            "cap": c.merged["OUTBOX_BACKOFF_MAX_SECONDS"],
            "base": c.merged["OUTBOX_BACKOFF_BASE_SECONDS"],
        }


def _consumer_tasks() -> list[Any]:
    """Idempotent consumer tasks of the current Celery app, the one ``manage.py`` and the
    worker load from the project (none without Celery)."""
    try:
        from celery import current_app
    except ImportError:  # pragma: no cover - exercised only without Celery installed
        return []
    try:
        registered = list(current_app.tasks.values())
    except RuntimeError:  # an app with autofinalize=False, not finalized yet
        registered = []
    return [
        task
        for task in registered
        if getattr(getattr(task, "run", None), "__idempotent_consumer__", False)
    ]


def _early_acks(c: Context) -> Iterator[Finding]:
    for task in _consumer_tasks():
        if not task.acks_late:
            yield {"task": task.name}


def _lost_with_worker(c: Context) -> Iterator[Finding]:
    for task in _consumer_tasks():
        if task.acks_late and not task.reject_on_worker_lost:
            yield {"task": task.name}


def _retention_below_redelivery(c: Context) -> Iterator[Finding]:
    try:
        from celery import current_app
    except ImportError:  # pragma: no cover - exercised only without Celery installed
        return
    retention = _number("INBOX_RETENTION_SECONDS", c.merged)
    horizon, source = _redelivery_horizon(current_app, _consumer_tasks(), c.merged)
    if retention is not None and retention < horizon:
        yield {
            "retention": c.merged["INBOX_RETENTION_SECONDS"],
            "source": source,
            "horizon": horizon,
        }


def _redelivery_horizon(app: Any, tasks: list[Any], merged: Mapping[str, Any]) -> tuple[float, str]:
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
    base = _number("OUTBOX_BACKOFF_BASE_SECONDS", merged)
    cap = _number("OUTBOX_BACKOFF_MAX_SECONDS", merged)
    attempts = _integer("OUTBOX_MAX_ATTEMPTS", merged)
    if base is not None and cap is not None and attempts is not None:
        span = sum(min(cap, base * 2 ** min(n, 62)) for n in range(max(attempts - 1, 0)))
        candidates.append((float(span), "the outbox's retry span (OUTBOX_BACKOFF_*)"))
    return max(candidates)


def _outbox_retry_horizon(merged: Mapping[str, Any]) -> float | None:
    """The longest time between an event's first publish and its last retry: every backoff
    at its ceiling until OUTBOX_MAX_ATTEMPTS, plus one relay lease (a relay that died between
    publishing and recording it is replaced once its lease runs out). None while a setting is
    invalid (E022/E023 say so)."""
    base = _number("OUTBOX_BACKOFF_BASE_SECONDS", merged)
    cap = _number("OUTBOX_BACKOFF_MAX_SECONDS", merged)
    attempts = _integer("OUTBOX_MAX_ATTEMPTS", merged)
    lease = _number("OUTBOX_RELAY_LEASE_SECONDS", merged)
    if base is None or cap is None or attempts is None or lease is None:
        return None
    span = sum(min(cap, base * 2 ** min(n, 62)) for n in range(max(attempts - 1, 0)))
    return float(span + lease)


def _duplicate_window_below_horizon(c: Context) -> Iterator[Finding]:
    """NATS routes whose declared duplicate window (the route's ``duplicate_window`` option,
    JetStream's 120 s default when absent) the relay's retries can outlast. The server is not
    asked: a check never opens a network connection."""
    from django_idempotency.publishers.nats import DEFAULT_DUPLICATE_WINDOW, NATSPublisher
    from django_idempotency.publishers.routing import route_setting

    horizon = _outbox_retry_horizon(c.merged)
    if horizon is None:
        return
    for pattern, route, backend in _publisher_classes(c):
        if not (isinstance(backend, type) and issubclass(backend, NATSPublisher)):
            continue
        window = route.options.get("duplicate_window", DEFAULT_DUPLICATE_WINDOW)
        if _is_number(window) and window < horizon:
            declared = "duplicate_window" in route.options
            yield {
                "where": route_setting(pattern),
                "window": window,
                "source": "the route's duplicate_window"
                if declared
                else "JetStream's default; the route declares no duplicate_window",
                "horizon": horizon,
            }


def _no_skip_locked(c: Context) -> Iterator[Finding]:
    """Asks the connection's features, so it runs only for the databases Django names."""
    from django.db import connections, router

    from django_idempotency.models import OutboxEvent

    alias = router.db_for_write(OutboxEvent)
    if alias not in (c.databases or ()):
        return
    features = connections[alias].features
    if features.has_select_for_update and not features.has_select_for_update_skip_locked:
        yield {"alias": alias}


# --- conditions: Redis fast path and operations ------------------------------------------------


def _cache(c: Context) -> tuple[str, Mapping[str, Any]] | None:
    """(alias, its CACHES entry) when CACHE_ALIAS names a configured cache."""
    alias = c.merged["CACHE_ALIAS"]
    caches = getattr(settings, "CACHES", {})
    if isinstance(alias, str) and alias in caches:
        return alias, caches[alias]
    return None


def _unknown_cache(c: Context) -> Iterator[Finding]:
    alias = c.merged["CACHE_ALIAS"]
    if alias is not None and _cache(c) is None:
        yield {"alias": alias}


def _not_django_redis(c: Context) -> Iterator[Finding]:
    found = _cache(c)
    if found is not None and found[1].get("BACKEND") != _DJANGO_REDIS_BACKEND:
        yield {"alias": found[0], "backend": found[1].get("BACKEND")}


def _no_socket_timeouts(c: Context) -> Iterator[Finding]:
    found = _cache(c)
    if found is None or found[1].get("BACKEND") != _DJANGO_REDIS_BACKEND:
        return
    options = found[1].get("OPTIONS") or {}
    if not options.get("SOCKET_TIMEOUT") or not options.get("SOCKET_CONNECT_TIMEOUT"):
        yield {"alias": found[0]}


def _on_without_package(name: str, module: str) -> Callable[[Context], Iterator[Finding]]:
    """The setting asked for explicitly (a default of True does not insist) but not installed."""

    def condition(c: Context) -> Iterator[Finding]:
        if name not in c.user:
            return
        try:
            wanted = parse_bool(name, c.user[name])
        except IdempotencyConfigurationError:
            return  # E060 says so
        if wanted and not importable(module):
            yield {}

    return condition


# --- conditions: the partitioned records and outbox tables ---------------------------------------

#: Each partitioned table's setting and label (``operations/partitions.py``'s layouts, without
#: importing the models here), and what goes wrong when the table is partitioned without it.
_PARTITIONED = (
    (
        "RECORD_PARTITIONS",
        "records",
        "every claim would fail (ON CONFLICT needs a unique index the partitioned table cannot "
        "have)",
    ),
    (
        "OUTBOX_PARTITIONS",
        "outbox",
        "publish() with a given event_id would not look it up across partitions, and no task "
        "would create the partitions ahead",
    ),
    (
        "INBOX_PARTITIONS",
        "inbox",
        "every consumer would fail (ON CONFLICT needs a unique index the partitioned table "
        "cannot have)",
    ),
)


def _partitions_wanted(c: Context, setting: str) -> bool:
    try:
        return parse_bool(setting, c.merged[setting])
    except IdempotencyConfigurationError:
        return False  # E080 says so


def _records_vendor(label: str = "records") -> tuple[str, str | None]:
    """The table's database alias and vendor, from its ENGINE (no connection)."""
    from django.db import connections, router
    from django.db.utils import load_backend

    from django_idempotency.operations.partitions import LAYOUTS

    alias = router.db_for_write(LAYOUTS[label].model)
    try:
        engine = connections.settings[alias]["ENGINE"]
        return alias, str(load_backend(engine).DatabaseWrapper.vendor)
    except Exception:  # an ENGINE that does not load is Django's own error to report
        return alias, None


def _partitions_off_postgresql(c: Context) -> Iterator[Finding]:
    for setting, label, _ in _PARTITIONED:
        alias, vendor = _records_vendor(label)
        if _partitions_wanted(c, setting) and vendor is not None and vendor != "postgresql":
            yield {"setting": setting, "label": label, "alias": alias, "vendor": vendor}


def record_layout(alias: str, label: str = "records") -> tuple[bool, datetime | None, datetime]:
    """Whether the table is partitioned, where its partitions end (None: it has none) and
    the database's time. Connects; only for rows tagged ``database``."""
    from django_idempotency.db import database_now
    from django_idempotency.operations import partitions

    layout = partitions.LAYOUTS[label]
    now = database_now(alias)
    if not partitions.is_partitioned(alias, layout):
        return False, None, now
    ends = [part.end for part in partitions.partitions(alias, layout)]
    return True, max(ends, default=None), now


def _layouts(
    c: Context,
) -> Iterator[tuple[str, str, str, str, tuple[bool, datetime | None, datetime]]]:
    """Each table's setting, label, consequence, alias and layout, when Django asked to check
    its database and it is PostgreSQL (elsewhere there is no layout to check)."""
    for setting, label, consequence in _PARTITIONED:
        alias, vendor = _records_vendor(label)
        if alias in (c.databases or ()) and vendor == "postgresql":
            yield setting, label, consequence, alias, record_layout(alias, label)


def _partitioned_layout_missing(c: Context) -> Iterator[Finding]:
    for setting, label, _, alias, (partitioned, _, _) in _layouts(c):
        if _partitions_wanted(c, setting) and not partitioned:
            yield {"setting": setting, "label": label, "alias": alias}


def _partitioned_without_setting(c: Context) -> Iterator[Finding]:
    for setting, label, consequence, alias, (partitioned, _, _) in _layouts(c):
        if not _partitions_wanted(c, setting) and partitioned:
            yield {"setting": setting, "label": label, "alias": alias, "why": consequence}


def _next_partition_missing(c: Context) -> Iterator[Finding]:
    span = _integer("PARTITION_SPAN_DAYS", c.merged) or 1
    for setting, label, _, _, (partitioned, covered_until, now) in _layouts(c):
        if not (_partitions_wanted(c, setting) and partitioned):
            continue
        if covered_until is None or covered_until <= now + timedelta(days=max(span, 1)):
            yield {
                "label": label,
                "until": "nothing" if covered_until is None else covered_until.isoformat(),
                "table": "" if label == "records" else f" --table {label}",
                "task": f"maintain_{'record' if label == 'records' else label}_partitions",
                "writes": {"records": "claims", "outbox": "publish()"}.get(label, "consumers"),
            }


# --- conditions: going to production (``check --deploy``) --------------------------------------

#: A day: how long payment clients and gateways commonly retry, and the default TTL_SECONDS.
RETRY_WINDOW_SECONDS = 86400
#: PgBouncer's default port.
_PGBOUNCER_PORT = "6432"
#: The Celery broker schemes that are Redis.
_REDIS_SCHEMES = frozenset({"redis", "rediss", "redis+socket", "sentinel", "sentinel+ssl"})
#: What each table needs run now and then: its sweep, or with day partitions the task that
#: creates and drops them (``tasks.BEAT_SCHEDULE`` holds an entry for each).
_UPKEEP = (
    ("records", "RECORD_PARTITIONS", "sweep_idempotency_records", "maintain_record_partitions"),
    ("outbox", "OUTBOX_PARTITIONS", "sweep_outbox_events", "maintain_outbox_partitions"),
    ("inbox", "INBOX_PARTITIONS", "sweep_processed_messages", "maintain_inbox_partitions"),
)
#: Rows this long past their sweep's cutoff say no sweep has run.
_OVERDUE = timedelta(days=1)


def _app_models() -> list[Any]:
    from django.apps import apps

    return list(apps.get_app_config("django_idempotency").get_models())


def _url_views() -> Iterator[Any]:
    """The view callables of the project's URLconf (Django's own URL checks import it too)."""
    from django.urls import URLPattern, URLResolver, get_resolver

    def walk(patterns: Iterable[Any]) -> Iterator[Any]:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns)
            elif isinstance(pattern, URLPattern):
                yield pattern.callback

    try:
        yield from walk(get_resolver().url_patterns)
    except Exception:  # a URLconf that does not import is Django's own error to report
        return


def _lets_anonymous_in(view: Any) -> bool:
    """A DRF view whose permission classes are all ``AllowAny`` (DRF's own default)."""
    from rest_framework.permissions import AllowAny

    cls = getattr(view, "cls", None)
    initkwargs = getattr(view, "initkwargs", None) or {}
    classes = initkwargs.get("permission_classes", getattr(cls, "permission_classes", ()))
    return all(isinstance(item, type) and issubclass(item, AllowAny) for item in classes)


def _anonymous_mixin_views() -> list[str]:
    """``IdempotencyMixin`` views that anonymous clients reach with the shared scope."""
    if not importable("rest_framework"):
        return []
    from django_idempotency.drf import IdempotencyMixin

    found: list[str] = []
    for view in _url_views():
        cls = getattr(view, "cls", None)
        if (
            isinstance(cls, type)
            and issubclass(cls, IdempotencyMixin)
            and cls.get_idempotency_scope is IdempotencyMixin.get_idempotency_scope
            and _lets_anonymous_in(view)
        ):
            name = f"{cls.__module__}.{cls.__qualname__}"
            if name not in found:
                found.append(name)
    return found


def _shared_anonymous_scope(c: Context) -> Iterator[Finding]:
    if not _is_default_resolver(c.merged["SCOPE_RESOLVER"]):
        return
    views = _anonymous_mixin_views()
    if views:
        shown = ", ".join(views[:3]) + (f" and {len(views) - 3} more" if len(views) > 3 else "")
        yield {"where": f"{shown} let anonymous clients in (permission_classes AllowAny)"}
    from django.db import DatabaseError, router

    from django_idempotency.models import IdempotencyRecord

    alias = router.db_for_write(IdempotencyRecord)
    if alias not in (c.databases or ()):
        return
    try:
        used = (
            IdempotencyRecord.objects.using(alias)
            .filter(scope=str(c.merged["ANONYMOUS_SCOPE"]))
            .exists()
        )
    except DatabaseError:  # no tables yet: E084 says so
        return
    if used:
        yield {"where": f"database {alias!r} holds keys sent anonymously"}


def _behind_a_pooler(settings_dict: Mapping[str, Any]) -> str | None:
    """Why a database looks like a pooler that hands sessions around (PgBouncer in transaction
    mode), from its settings alone; None when nothing says so."""
    if settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
        return "DISABLE_SERVER_SIDE_CURSORS is True, as Django asks behind transaction pooling"
    if str(settings_dict.get("PORT") or "") == _PGBOUNCER_PORT:
        return f"PORT is {_PGBOUNCER_PORT}, PgBouncer's"
    if "pgbouncer" in str(settings_dict.get("HOST") or "").lower():
        return "its HOST names PgBouncer"
    return None


def _session_features_behind_pooler(c: Context) -> Iterator[Finding]:
    from django.db import connections, router

    wanted = []
    for name in ("PREPARED_STATEMENTS", "TAKE_OVER_DEAD_OWNERS"):
        try:
            if parse_bool(name, c.merged[name]):
                wanted.append(name)
        except IdempotencyConfigurationError:
            pass  # E011 says so
    if not wanted:
        return
    aliases = sorted({router.db_for_write(model) for model in _app_models()})
    for alias in aliases:
        settings_dict = connections.settings.get(alias) or {}
        if "postgresql" not in str(settings_dict.get("ENGINE", "")):
            continue
        evidence = _behind_a_pooler(settings_dict)
        if evidence is not None:
            yield {
                "alias": alias,
                "evidence": evidence,
                "settings": " and ".join(wanted),
                "off": ", ".join(f"IDEMPOTENCY[{name!r}] = False" for name in wanted),
            }


def _ttl_below_retry_window(c: Context) -> Iterator[Finding]:
    ttl = _number("TTL_SECONDS", c.merged)
    if ttl is not None and 0 < ttl < RETRY_WINDOW_SECONDS:
        yield {"ttl": c.merged["TTL_SECONDS"], "hours": ttl / 3600}


def _celery_apps(c: Context) -> list[Any]:
    """The Celery apps the outbox sends through: each CeleryPublisher route's ``app`` (the
    current app when it names none), and the current app for the default kick."""
    if not importable("celery"):
        return []
    from celery import current_app

    from django_idempotency.publishers.celery import CeleryPublisher

    apps: list[Any] = []
    if _routes(c) and c.merged["OUTBOX_KICK"] == DEFAULTS["OUTBOX_KICK"]:
        apps.append(current_app)
    for _, route, backend in _publisher_classes(c):
        if isinstance(backend, type) and issubclass(backend, CeleryPublisher):
            path = route.options.get("app")
            try:
                app = import_string(path) if isinstance(path, str) else path or current_app
            except ImportError:
                continue  # E028 and the publisher itself say so
            apps.append(app)
    unique: list[Any] = []
    for app in apps:
        if all(app is not seen for seen in unique):
            unique.append(app)
    return unique


def _redis_broker_without_timeouts(c: Context) -> Iterator[Finding]:
    for app in _celery_apps(c):
        url = str(app.conf.broker_url or "")
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in _REDIS_SCHEMES:
            continue
        options = app.conf.broker_transport_options or {}
        missing = [
            name for name in ("socket_timeout", "socket_connect_timeout") if not options.get(name)
        ]
        if missing:
            yield {"app": app.main or "the current app", "missing": " and ".join(missing)}


def _local_replay_on(c: Context) -> Iterator[Finding]:
    seconds = _number("LOCAL_REPLAY_SECONDS", c.merged)
    if seconds is not None and seconds > 0:
        yield {"seconds": c.merged["LOCAL_REPLAY_SECONDS"]}


def _upkeep_tasks(c: Context) -> list[str]:
    """The task each table needs scheduled: its sweep, or its partitions' maintenance."""
    return [
        f"django_idempotency.tasks.{maintain if _partitions_wanted(c, setting) else sweep}"
        for _, setting, sweep, maintain in _UPKEEP
    ]


def _scheduled_tasks(c: Context) -> set[str] | None:
    """The task names the project's Celery beat runs; None when it cannot be told (no beat
    schedule, or django-celery-beat's scheduler without ``--database``)."""
    if not importable("celery"):
        return None
    from celery import current_app

    scheduler = str(current_app.conf.beat_scheduler or "")
    if "DatabaseScheduler" in scheduler:
        return _database_scheduled_tasks(c)
    schedule = current_app.conf.beat_schedule or {}
    if not schedule:
        return None  # no beat here: cron may run the commands; the database tells (below)
    return {str(entry.get("task")) for entry in schedule.values() if isinstance(entry, Mapping)}


def _database_scheduled_tasks(c: Context) -> set[str] | None:
    if not importable("django_celery_beat"):
        return None
    from django.db import DatabaseError, router
    from django_celery_beat.models import PeriodicTask  # type: ignore[import-untyped]

    alias = router.db_for_read(PeriodicTask)
    if alias not in (c.databases or ()):
        return None
    try:
        return set(
            PeriodicTask.objects.using(alias).filter(enabled=True).values_list("task", flat=True)
        )
    except DatabaseError:  # django-celery-beat not migrated: its own problem
        return None


def _overdue_rows(c: Context) -> Iterator[Finding]:
    """Tables holding rows a day past their sweep's cutoff: no sweep has run. Asked only of
    the databases Django names, each an index range scan that stops at the first row."""
    from django.db import DatabaseError, router

    from django_idempotency.db import database_now
    from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage

    for label, setting, sweep, _ in _UPKEEP:
        if _partitions_wanted(c, setting):
            continue  # retention drops whole partitions; W081 watches them
        model = {"records": IdempotencyRecord, "outbox": OutboxEvent, "inbox": ProcessedMessage}[
            label
        ]
        alias = router.db_for_write(model)
        if alias not in (c.databases or ()):
            continue
        try:
            now = database_now(alias)
            rows: Any = model._default_manager.using(alias)
            if label == "records":
                overdue = rows.expired(now - _OVERDUE)
            elif label == "outbox":
                retention = timedelta(seconds=c.merged["OUTBOX_RETENTION_SECONDS"])
                overdue = rows.published_before(now - retention - _OVERDUE)
            else:
                retention = timedelta(seconds=c.merged["INBOX_RETENTION_SECONDS"])
                overdue = rows.processed_before(now - retention - _OVERDUE)
            found = overdue.exists()
        except (DatabaseError, TypeError, ValueError):  # no tables yet (E084), bad settings
            continue
        if found:
            yield {
                "problem": f"the {label} table of database {alias!r} holds rows more than a "
                f"day past their sweep, so {sweep} has not run"
            }


def _sweeps_not_scheduled(c: Context) -> Iterator[Finding]:
    scheduled = _scheduled_tasks(c)
    if scheduled is not None:
        missing = [task for task in _upkeep_tasks(c) if task not in scheduled]
        if missing:
            yield {
                "problem": "the Celery beat schedule does not run "
                + ", ".join(task.rpartition(".")[2] for task in missing)
            }
            return
    yield from _overdue_rows(c)


# --- conditions: the database has the app's tables ---------------------------------------------


def _migrating() -> bool:
    """Whether ``manage.py migrate`` is running the checks: it runs the database checks before
    it migrates, and a report that the migrations are not applied would only tell it to do
    what it is about to do. Django passes no flag; its command is on the stack."""
    from django.core.management.commands.migrate import Command as Migrate

    frame: Any = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Migrate):
            return True
        frame = frame.f_back
    return False


def _not_migrated(c: Context) -> Iterator[Finding]:
    from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, router
    from django.db.migrations.executor import MigrationExecutor

    if not c.databases or _migrating():
        return
    by_alias: dict[str, list[Any]] = {}
    for model in _app_models():
        alias = router.db_for_write(model)
        if alias in c.databases and router.allow_migrate_model(alias, model):
            by_alias.setdefault(alias, []).append(model)
    for alias, models in sorted(by_alias.items()):
        connection = connections[alias]
        try:
            tables = set(connection.introspection.table_names())
            executor = MigrationExecutor(connection)
            leaves = [node for node in executor.loader.graph.leaf_nodes() if node[0] == _APP_LABEL]
            plan = executor.migration_plan(leaves)
        except DatabaseError:  # a database that does not answer is Django's own to report
            continue
        missing = sorted(
            {model._meta.db_table for model in models if model._meta.db_table not in tables}
        )
        unapplied = [
            migration.name
            for migration, backwards in plan
            if migration.app_label == _APP_LABEL and not backwards
        ]
        if not (missing or unapplied):
            continue
        if len(missing) == len({model._meta.db_table for model in models}):
            problem = "has none of django_idempotency's tables (its migrations never ran)"
        else:
            problems = (
                [f"lacks django_idempotency's tables {', '.join(missing)}"] if missing else []
            )
            if unapplied:
                problems.append(
                    f"has not applied django_idempotency's migrations {', '.join(unapplied)}"
                )
            problem = " and ".join(problems)
        yield {
            "alias": alias,
            "problem": problem,
            "database": "" if alias == DEFAULT_DB_ALIAS else f" --database {alias}",
        }


_DURATIONS = (
    "OUTBOX_RELAY_LEASE_SECONDS",
    "OUTBOX_BACKOFF_BASE_SECONDS",
    "OUTBOX_BACKOFF_MAX_SECONDS",
    "OUTBOX_POLL_SECONDS",
    "OUTBOX_RETENTION_SECONDS",
    "INBOX_RETENTION_SECONDS",
)

#: The request layer's settings (:func:`check_settings` runs these).
SETTINGS_CHECKS: tuple[Check, ...] = (
    Check(
        E001,
        _not_a_dict,
        "IDEMPOTENCY must be a dict.",
        "Set IDEMPOTENCY = {{...}} with the settings to change, or remove it.",
        reads_settings=False,
    ),
    Check(
        W001,
        _unknown_keys,
        "IDEMPOTENCY[{name!r}] is not a known setting and is ignored.",
        "Check its spelling against the settings reference.",
    ),
    Check(
        E002,
        _bad_numbers("LEASE_SECONDS"),
        "IDEMPOTENCY['LEASE_SECONDS'] must be a positive number of seconds, not {value}.",
        "Set it a little above the longest time an idempotent view takes, for example 30.",
    ),
    Check(
        E003,
        _bad_numbers("TTL_SECONDS"),
        "IDEMPOTENCY['TTL_SECONDS'] must be a positive number of seconds, not {value}.",
        "Set it to how long clients may retry, for example 86400 (24 hours).",
    ),
    Check(
        E004,
        _ttl_below_lease,
        "IDEMPOTENCY['TTL_SECONDS'] ({ttl}) is shorter than LEASE_SECONDS ({lease}).",
        "A key must outlive the lease of the request that holds it.",
    ),
    Check(
        E005,
        _importable_callable("SCOPE_RESOLVER"),
        "IDEMPOTENCY['SCOPE_RESOLVER'] = {value!r} {problem}.",
        "Use the dotted path of a callable taking the request and returning a str.",
    ),
    Check(
        E006,
        _not_status_codes,
        "IDEMPOTENCY['STORED_STATUS_CODES'] must be a collection of HTTP status codes.",
        "For example range(100, 500), the default, which stores all but 5xx.",
    ),
    Check(
        E007,
        _not_header_names,
        "IDEMPOTENCY['STORED_RESPONSE_HEADERS'] must be a list of header names.",
        "For example ['Content-Type', 'Location'].",
    ),
    Check(
        W002,
        _never_stored_headers,
        "IDEMPOTENCY['STORED_RESPONSE_HEADERS'] lists {names}, which are never stored.",
        "Remove them: replaying cookies or credentials would leak them.",
    ),
    Check(
        E008,
        _bad_numbers("MAX_RESPONSE_BYTES", whole=True, zero=True),
        "IDEMPOTENCY['MAX_RESPONSE_BYTES'] must be a non-negative integer, not {value}.",
        "Responses larger than this are recorded without their body.",
    ),
    Check(
        E009,
        _bad_header_settings,
        "IDEMPOTENCY[{name!r}] must be an HTTP header name, not {value!r}.",
        "Use letters, digits and dashes, for example 'Idempotency-Key'.",
    ),
    Check(
        E010,
        _bad_middleware_paths,
        "IDEMPOTENCY['MIDDLEWARE_PATHS'] must be a list of regular expressions.",
        "For example [r'^/api/payments/'].",
    ),
    Check(
        E011,
        _not_booleans(
            "KEY_REQUIRED",
            "LEASE_HEARTBEAT",
            "LOG_KEYS",
            "TAKE_OVER_DEAD_OWNERS",
            "PREPARED_STATEMENTS",
        ),
        BOOLEAN_MESSAGE,
    ),
    Check(
        E012,
        _bad_middleware_methods,
        "IDEMPOTENCY['MIDDLEWARE_METHODS'] must be a list of HTTP methods.",
        "For example ['POST', 'PATCH'].",
    ),
    Check(
        E014,
        _bad_credential_scope,
        CREDENTIAL_SCOPE_MESSAGE,
        "'digest' scopes an anonymous request that carries credentials by a keyed digest of "
        "them; 'refuse' answers it 400.",
    ),
    Check(
        E015,
        _bad_credential_headers,
        HEADER_NAMES_MESSAGE,
        "For example ('Authorization',), or ('Authorization', 'X-Api-Key').",
    ),
    Check(
        E016,
        _bad_numbers("ATTACH_DEFAULT_WAIT_SECONDS", "ATTACH_MAX_WAIT_SECONDS", zero=True),
        "IDEMPOTENCY[{name!r}] must be a number of seconds >= 0, not {value}.",
        "0 turns waiting off; remove it to use the default, {default!r}.",
    ),
    Check(
        E017,
        _bad_numbers("ATTACH_MAX_WAITERS", "ATTACH_MAX_WAITERS_PER_SCOPE", whole=True, zero=True),
        "IDEMPOTENCY[{name!r}] must be an integer >= 0, not {value}.",
        "It bounds the duplicates waiting in one process (per scope: of one client); 0 answers "
        "every one 409 at once.",
    ),
    Check(
        E018,
        _bad_numbers("ATTACH_POLL_SECONDS"),
        "IDEMPOTENCY['ATTACH_POLL_SECONDS'] must be a positive number of seconds, not {value}.",
        "Remove it to use the default, {default!r}.",
    ),
    Check(
        E019,
        _bad_numbers("HANDOFF_HOLD_SECONDS"),
        "IDEMPOTENCY['HANDOFF_HOLD_SECONDS'] must be a positive number of seconds, not {value}.",
        "It is how long a worker holds a handed-off key; remove it to use the default, "
        "{default!r}.",
    ),
)

#: The project around the app: middleware, databases, time zones, REST framework.
PROJECT_CHECKS: tuple[Check, ...] = (
    Check(
        E013,
        _view_middleware_after_ours,
        f"{{path}} comes after {MIDDLEWARE} in MIDDLEWARE and defines process_view: "
        "IdempotencyMiddleware calls the view itself from its own process_view, so that one "
        "would never run.",
        "Put IdempotencyMiddleware last in MIDDLEWARE.",
        reads_settings=False,
    ),
    Check(
        W003,
        _sqlite_without_immediate,
        "Database {alias!r} is SQLite without IMMEDIATE transactions: concurrent requests fail "
        "with 'database is locked' (503 idempotency_store_unavailable) instead of waiting.",
        "Set DATABASES[{alias!r}]['OPTIONS'] = {{'transaction_mode': 'IMMEDIATE', "
        "'timeout': 20}} (Django 5.1+), or use PostgreSQL in production.",
        reads_settings=False,
    ),
    Check(
        W004,
        _before_authentication,
        "IdempotencyMiddleware comes before AuthenticationMiddleware.",
        "Move it after AuthenticationMiddleware so keys are scoped by user.",
        reads_settings=False,
    ),
    Check(
        W005,
        _records_routed_away,
        "IdempotencyRecord is routed to database {alias!r}, not 'default': a view's writes to "
        "another database and its stored response commit in two transactions, so exactly-once "
        "holds only for the writes in {alias!r}.",
        "Route IdempotencyRecord to the database your idempotent views write to, or accept "
        "that writes elsewhere may happen twice after a crash between the two commits.",
        reads_settings=False,
    ),
    Check(
        W006,
        _naive_datetimes,
        "USE_TZ is False: leases are measured by the database clock in UTC.",
        "Set USE_TZ = True.",
        reads_settings=False,
    ),
    Check(
        W011,
        _waiters_hold_every_thread,
        "IDEMPOTENCY['ATTACH_MAX_WAITERS_PER_SCOPE'] is {per_scope}, and the server runs "
        "{threads} thread(s) per process ({source}): one client's duplicates waiting with "
        "Prefer: wait could hold every thread.",
        "Set ATTACH_MAX_WAITERS_PER_SCOPE below the threads per process (docs/howto/attach.md).",
    ),
    Check(
        W007,
        _credentials_behind_middleware,
        "IdempotencyMiddleware guards MIDDLEWARE_PATHS with the default SCOPE_RESOLVER, and "
        "REST framework authenticates with {classes}: behind the middleware those clients are "
        "scoped by a digest of their credentials, not by user.",
        "Use IdempotencyMixin, or @idempotent below @api_view, for user scopes; or set "
        "IDEMPOTENCY['CREDENTIAL_SCOPE'] = 'refuse' to answer them 400.",
    ),
)

OUTBOX_CHECKS: tuple[Check, ...] = (
    Check(E020, _bad_routes, "{where} {problem}.", "See docs/publishers.md."),
    Check(
        E021,
        _bad_publishers,
        "{where} = {backend!r} {problem}.",
        "Install the publisher's extra (celery, amqp, webhook), fix the path, or subclass "
        "django_idempotency.publishers.Publisher.",
    ),
    Check(
        E028,
        _options_refused,
        "{where}: {publisher} does not accept these OPTIONS: {problem}.",
        "Spell the OPTIONS as the publisher's documentation names them.",
    ),
    Check(
        W024,
        _no_catch_all,
        "IDEMPOTENCY['OUTBOX_PUBLISHERS'] has no catch-all '*' route (routed: {routed}): "
        "publish() of a topic no pattern matches raises UnroutableTopic.",
        "Add a '*' route, or silence this check when every topic the project publishes has "
        "its pattern (or it publishes nothing).",
    ),
    Check(
        E027,
        _kick_without_publishers,
        "IDEMPOTENCY['OUTBOX_KICK'] is set but OUTBOX_PUBLISHERS is empty: every publish() "
        "raises UnroutableTopic.",
        "Route topics to a publisher, for example {{'*': "
        "'django_idempotency.publishers.celery.CeleryPublisher'}}, or remove OUTBOX_KICK.",
    ),
    Check(
        W025,
        _kick_without_celery,
        "Celery is not installed, so the default OUTBOX_KICK relays the outbox in a "
        "background thread of each process that publishes.",
        "Install Celery and run a worker with the beat schedule, or set OUTBOX_KICK = None "
        "and run `manage.py outbox_relay --loop`; silence this check to keep the thread.",
    ),
    Check(
        E022,
        _bad_numbers("OUTBOX_BATCH_SIZE", "OUTBOX_MAX_ATTEMPTS", "SWEEP_BATCH_SIZE", whole=True),
        "IDEMPOTENCY[{name!r}] must be a positive integer, not {value}.",
        "Remove it to use the default, {default!r}.",
    ),
    Check(
        E023,
        _bad_numbers(*_DURATIONS),
        "IDEMPOTENCY[{name!r}] must be a positive number of seconds, not {value}.",
        "Remove it to use the default, {default!r}.",
    ),
    Check(
        E024,
        _backoff_cap_below_base,
        "IDEMPOTENCY['OUTBOX_BACKOFF_MAX_SECONDS'] ({cap}) is below "
        "OUTBOX_BACKOFF_BASE_SECONDS ({base}).",
        "The cap must be at least the first delay.",
    ),
    Check(
        E025,
        _importable_callable("OUTBOX_KICK", optional=True),
        "IDEMPOTENCY['OUTBOX_KICK'] = {value!r} {problem}.",
        "Use the dotted path of a callable taking the database alias, or None.",
    ),
    Check(E026, _not_booleans("OUTBOX_REQUIRE_ATOMIC", "OUTBOX_NOTIFY"), BOOLEAN_MESSAGE),
    Check(
        W020,
        _retention_below_redelivery,
        "IDEMPOTENCY['INBOX_RETENTION_SECONDS'] ({retention}) is shorter than {source} "
        "({horizon:g} s).",
        "A message redelivered after its marker was swept runs again. Keep "
        "INBOX_RETENTION_SECONDS above the longest time a message can come back.",
    ),
    Check(
        W021,
        _early_acks,
        "Idempotent consumer task {task!r} runs without acks_late.",
        "Use @shared_task(acks_late=True) (or task_acks_late = True): otherwise a worker that "
        "dies mid-task has already acknowledged the message and it is lost, not redelivered.",
    ),
    Check(
        W023,
        _lost_with_worker,
        "Idempotent consumer task {task!r} runs without reject_on_worker_lost.",
        "Use @shared_task(acks_late=True, reject_on_worker_lost=True) (or "
        "task_reject_on_worker_lost = True): with the prefork pool, Celery acknowledges the "
        "message of a pool process that died mid-task, and it is lost. Silence this only for "
        "a worker pool that is not prefork.",
    ),
    Check(
        W026,
        _duplicate_window_below_horizon,
        "{where}: the NATS stream's duplicate window, {window:g} s ({source}), is shorter than "
        "the relay's retry horizon of {horizon:g} s: an event retried after the window is "
        "stored in the stream twice.",
        "Raise the stream's duplicate window (nats stream edit --dupe-window) above the horizon "
        "and declare it in the route's OPTIONS as 'duplicate_window' (seconds), or shorten the "
        "horizon (OUTBOX_MAX_ATTEMPTS, OUTBOX_BACKOFF_*, OUTBOX_RELAY_LEASE_SECONDS).",
    ),
    Check(
        W022,
        _no_skip_locked,
        "Database {alias!r} has no SELECT ... FOR UPDATE SKIP LOCKED.",
        "Outbox relays stay correct but wait on each other; run one relay, or use "
        "PostgreSQL, MariaDB 10.6+ or MySQL 8.",
        tags=(Tags.database,),
    ),
)

FAST_PATH_CHECKS: tuple[Check, ...] = (
    Check(
        E043,
        _bad_numbers("LOCAL_REPLAY_SECONDS", zero=True),
        "IDEMPOTENCY['LOCAL_REPLAY_SECONDS'] must be a number of seconds >= 0, not {value}.",
        "0 (the default) keeps no answer in memory; a few seconds cover a retry storm.",
    ),
    Check(
        E044,
        _bad_numbers("LOCAL_REPLAY_ENTRIES", whole=True),
        "IDEMPOTENCY['LOCAL_REPLAY_ENTRIES'] must be a whole number > 0, not {value}.",
        "The most answers one process keeps in memory; the default is 1000.",
    ),
    Check(
        E042,
        _bad_numbers("CACHE_RETRY_SECONDS", zero=True),
        "IDEMPOTENCY['CACHE_RETRY_SECONDS'] must be a number of seconds >= 0, not {value}.",
        "0 retries Redis on every request; the default is 5.",
        tags=(Tags.caches,),
    ),
    Check(
        E040,
        _unknown_cache,
        "IDEMPOTENCY['CACHE_ALIAS'] = {alias!r} is not an alias in CACHES.",
        "Name a django-redis cache from CACHES, or set it to None for the database only.",
        tags=(Tags.caches,),
    ),
    Check(
        E041,
        _not_django_redis,
        "CACHES[{alias!r}] (IDEMPOTENCY['CACHE_ALIAS']) uses {backend!r}; the fast path needs "
        f"{_DJANGO_REDIS_BACKEND!r}.",
        "Install the 'redis' extra (pip install -e '/path/to/django-idempotency[redis]' from "
        "a checkout, see docs/installation.md) and set that BACKEND.",
        tags=(Tags.caches,),
    ),
    Check(
        W040,
        _no_socket_timeouts,
        "CACHES[{alias!r}] (IDEMPOTENCY['CACHE_ALIAS']) sets no SOCKET_TIMEOUT or "
        "SOCKET_CONNECT_TIMEOUT: a Redis that hangs would hang every idempotent request.",
        "Set OPTIONS = {{'SOCKET_CONNECT_TIMEOUT': 0.1, 'SOCKET_TIMEOUT': 0.1}}; on a timeout "
        "the request falls back to the database.",
        tags=(Tags.caches,),
    ),
)

OPERATIONS_CHECKS: tuple[Check, ...] = (
    Check(E060, _not_booleans("REGISTER_ADMIN", "METRICS", "TRACING"), BOOLEAN_MESSAGE),
    Check(
        W060,
        _on_without_package("METRICS", "prometheus_client"),
        "IDEMPOTENCY['METRICS'] is True but prometheus_client is not installed, so it has no "
        "effect.",
        "Install the 'metrics' extra (pip install -e '/path/to/django-idempotency[metrics]' from "
        "a checkout, see docs/installation.md), or remove the setting.",
    ),
    Check(
        W061,
        _on_without_package("TRACING", "opentelemetry.trace"),
        "IDEMPOTENCY['TRACING'] is True but opentelemetry is not installed, so it has no effect.",
        "Install the 'otel' extra (pip install -e '/path/to/django-idempotency[otel]' from "
        "a checkout, see docs/installation.md), or remove the setting.",
    ),
)

STORAGE_CHECKS: tuple[Check, ...] = (
    Check(
        E080,
        _not_booleans("RECORD_PARTITIONS", "OUTBOX_PARTITIONS", "INBOX_PARTITIONS"),
        BOOLEAN_MESSAGE,
    ),
    Check(
        E081,
        _bad_numbers("PARTITION_SPAN_DAYS", "PARTITION_AHEAD_DAYS", whole=True),
        "IDEMPOTENCY[{name!r}] must be a positive whole number of days, not {value}.",
        "Remove it to use the default, {default!r}.",
    ),
    Check(
        E082,
        _partitions_off_postgresql,
        "IDEMPOTENCY[{setting!r}] is on, but the {label} database {alias!r} is "
        "{vendor!r}: day partitions are PostgreSQL's.",
        "Turn it off: on this database the sweep (idempotency_sweep, or its task) removes "
        "what has expired.",
    ),
    Check(
        E083,
        _partitioned_without_setting,
        "The {label} table in database {alias!r} is partitioned, but "
        "IDEMPOTENCY[{setting!r}] is off: {why}.",
        "Set IDEMPOTENCY[{setting!r}] = True, or move the table back first with "
        "`manage.py idempotency_partitions unpartition --table {label}`.",
        tags=(Tags.database,),
    ),
    Check(
        W080,
        _partitioned_layout_missing,
        "IDEMPOTENCY[{setting!r}] is on, but the {label} table in database {alias!r} is "
        "still one plain table.",
        "Writes are safe meanwhile (they take their locks; the unique constraint still holds). "
        "Run `manage.py idempotency_partitions partition --table {label}` once every process "
        "runs with the setting (docs/partitions.md).",
        tags=(Tags.database,),
    ),
    Check(
        W081,
        _next_partition_missing,
        "The partitions of the {label} table cover time only until {until}: the next partition "
        "does not exist yet, and {writes} past that moment will fail.",
        "Run `manage.py idempotency_partitions create{table}` now, and schedule it daily (or the "
        "{task} task of BEAT_SCHEDULE).",
        tags=(Tags.database,),
    ),
    Check(
        E084,
        _not_migrated,
        "Database {alias!r} {problem}: every request the app guards answers 503 until they "
        "are applied.",
        "Run `manage.py migrate django_idempotency{database}`.",
        tags=(Tags.database,),
        reads_settings=False,
    ),
)

#: ``manage.py check --deploy``: what is fine on a laptop and wrong in production.
#: ``docs/production.md`` lists them with the settings they watch.
DEPLOY_CHECKS: tuple[Check, ...] = (
    Check(
        W008,
        _shared_anonymous_scope,
        "Anonymous clients share one idempotency scope (ANONYMOUS_SCOPE), and {where}: one "
        "client's retry with another's key replays the other's response.",
        "Require authentication on guarded views, give anonymous clients scopes of their own "
        "with IDEMPOTENCY['SCOPE_RESOLVER'] (docs/howto/multi-tenant.md), or silence this "
        "check if anonymous clients send unguessable keys (UUIDs).",
        tags=(Tags.security,),
        deploy=True,
    ),
    Check(
        W009,
        _session_features_behind_pooler,
        "Database {alias!r} looks like a connection pooler that hands server sessions around "
        "after each transaction ({evidence}), and {settings} use session state: prepared "
        "statements fail on another session, and session locks are lost or leak.",
        "Set {off}; or use session pooling (or PgBouncer 1.21+ with max_prepared_statements for "
        "the statements) and silence this check.",
        tags=(Tags.database,),
        deploy=True,
    ),
    Check(
        W010,
        _ttl_below_retry_window,
        "IDEMPOTENCY['TTL_SECONDS'] is {ttl} ({hours:.3g} h): a client that retries later runs "
        "the request again, and payment clients and gateways commonly retry for a day.",
        "Set TTL_SECONDS to the longest time any client retries a request, 86400 (the default) "
        "or more; silence this check once you know every client stops sooner.",
        deploy=True,
    ),
    Check(
        W027,
        _redis_broker_without_timeouts,
        "The outbox sends through Celery app {app!r}, whose broker is Redis without "
        "{missing} in broker_transport_options: a Redis that stops answering hangs the relay "
        "and the kick after each commit for good.",
        "Set CELERY_BROKER_TRANSPORT_OPTIONS = {{'socket_timeout': 5, "
        "'socket_connect_timeout': 5}} (seconds); the relay retries what a timeout failed.",
        tags=(Tags.caches,),
        deploy=True,
    ),
    Check(
        W041,
        _local_replay_on,
        "IDEMPOTENCY['LOCAL_REPLAY_SECONDS'] is {seconds}: each process replays the answers it "
        "keeps in memory, so a key released in another process (an operator's release in the "
        "admin) is still replayed by the others for up to {seconds} s.",
        "With several processes, keep it to a few seconds where that is acceptable, or set it "
        "to 0 where a release must take effect everywhere at once; then silence this check.",
        deploy=True,
    ),
    Check(
        W062,
        _sweeps_not_scheduled,
        "The app's sweeps are not scheduled: {problem}. Expired keys, published events and old "
        "consumer markers then stay for ever, and the tables grow.",
        "Merge django_idempotency.tasks.BEAT_SCHEDULE into CELERY_BEAT_SCHEDULE (with "
        "django-celery-beat: `manage.py idempotency_periodic_tasks`), or run `manage.py "
        "idempotency_sweep` from cron (docs/tasks.md).",
        deploy=True,
    ),
)

#: Every check, in the order ``manage.py check`` reports them.
CHECKS: tuple[Check, ...] = (
    *SETTINGS_CHECKS,
    *PROJECT_CHECKS,
    *OUTBOX_CHECKS,
    *FAST_PATH_CHECKS,
    *OPERATIONS_CHECKS,
    *STORAGE_CHECKS,
    *DEPLOY_CHECKS,
)
BY_ID: dict[str, Check] = {check.id: check for check in CHECKS}


def register_all() -> None:
    """Register every row with Django's check framework (``AppConfig.ready()`` calls this)."""
    for check in CHECKS:
        register(check, *check.tags, deploy=check.deploy)


def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The request layer's settings checks, run directly (the rows are also registered)."""
    return [message for check in SETTINGS_CHECKS for message in check(app_configs, **kwargs)]
