"""Checks of the request layer: its settings (E001-E019, W001, W002) and the project around it:
middleware order, databases, time zones, REST framework, server threads (E013, W003-W007, W011).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from django_idempotency.checks import base
from django_idempotency.checks.base import (
    Check,
    Context,
    Finding,
    _bad_numbers,
    _importable_callable,
    _integer,
    _is_default_resolver,
    _not_booleans,
    _number,
)
from django_idempotency.checks.ids import (
    E001,
    E002,
    E003,
    E004,
    E005,
    E006,
    E007,
    E008,
    E009,
    E010,
    E011,
    E012,
    E013,
    E014,
    E015,
    E016,
    E017,
    E018,
    E019,
    W001,
    W002,
    W003,
    W004,
    W005,
    W006,
    W007,
    W011,
)
from django_idempotency.conf import (
    BOOLEAN_MESSAGE,
    CREDENTIAL_SCOPE_MESSAGE,
    DEFAULTS,
    HEADER_NAMES_MESSAGE,
    SENSITIVE_HEADERS,
    parse_credential_scope,
)
from django_idempotency.exceptions import IdempotencyConfigurationError

MIDDLEWARE = "django_idempotency.request.middleware.IdempotencyMiddleware"
_AUTHENTICATION_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def _middleware() -> list[str]:
    return [str(path) for path in getattr(settings, "MIDDLEWARE", None) or []]


# --- conditions: Layer 1 settings -------------------------------------------------------------


def _not_a_dict(c: Context) -> Iterator[Finding]:
    if not c.valid:
        yield {}


def _unknown_keys(c: Context) -> Iterator[Finding]:
    for name in sorted(set(c.user) - set(DEFAULTS), key=str):
        yield {"name": name}


def _ttl_below_lease(c: Context) -> Iterator[Finding]:
    lease, ttl = _number("LEASE_SECONDS", c.merged), _number("TTL_SECONDS", c.merged)
    if lease is not None and ttl is not None and 0 < ttl < lease:
        yield {"ttl": c.merged["TTL_SECONDS"], "lease": c.merged["LEASE_SECONDS"]}


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


def _drf_credential_classes() -> list[str]:
    """DRF's authentication classes (its defaults applied) that are not session based."""
    if not base.importable("rest_framework"):
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
