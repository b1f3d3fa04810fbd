"""Checks of the outbox and its consumers: publisher routes and their options, the kick, retry
and retention durations, consumer tasks' acknowledgements, NATS duplicate windows, and
SKIP LOCKED for relays side by side (E020-E028, W020-W026)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from django.core.checks import Tags
from django.utils.module_loading import import_string

from django_idempotency.checks import base
from django_idempotency.checks.base import (
    Check,
    Context,
    Finding,
    _bad_numbers,
    _importable_callable,
    _integer,
    _is_number,
    _not_booleans,
    _number,
)
from django_idempotency.checks.ids import (
    E020,
    E021,
    E022,
    E023,
    E024,
    E025,
    E026,
    E027,
    E028,
    W020,
    W021,
    W022,
    W023,
    W024,
    W025,
    W026,
)
from django_idempotency.conf import BOOLEAN_MESSAGE, DEFAULTS

#: Redis and SQS redeliver an unacknowledged message after this long (their default).
_DEFAULT_VISIBILITY_TIMEOUT = 3600


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
        and not base.importable("celery")
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


_DURATIONS = (
    "OUTBOX_RELAY_LEASE_SECONDS",
    "OUTBOX_BACKOFF_BASE_SECONDS",
    "OUTBOX_BACKOFF_MAX_SECONDS",
    "OUTBOX_POLL_SECONDS",
    "OUTBOX_RETENTION_SECONDS",
    "INBOX_RETENTION_SECONDS",
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
