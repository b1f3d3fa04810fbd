"""The deploy checks, run only by ``manage.py check --deploy``: what is fine on a laptop and wrong
in production (W008, W009, W010, W027, W041, W062). ``docs/production.md`` lists them with the
settings they watch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

from django.core.checks import Tags
from django.utils.module_loading import import_string

from django_idempotency.checks import base
from django_idempotency.checks.base import (
    Check,
    Context,
    Finding,
    _app_models,
    _is_default_resolver,
    _number,
)
from django_idempotency.checks.ids import W008, W009, W010, W027, W041, W062
from django_idempotency.checks.outbox import _publisher_classes, _routes
from django_idempotency.checks.partitions import _partitions_wanted
from django_idempotency.conf import DEFAULTS, parse_bool
from django_idempotency.exceptions import IdempotencyConfigurationError

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
    if not base.importable("rest_framework"):
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
    if not base.importable("celery"):
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


def _answers_kept_in_memory(c: Context) -> Iterator[Finding]:
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
    if not base.importable("celery"):
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
    if not base.importable("django_celery_beat"):
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
        _answers_kept_in_memory,
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
