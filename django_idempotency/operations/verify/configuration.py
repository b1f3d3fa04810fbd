"""The checks that decide whether the others can run: the app's system checks, its databases
(reachable, migrated, writable) and the Redis copy's cache.

A project that fails one gets a row saying what to fix, and the other checks are skipped rather
than failing for a reason that is not theirs.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import DatabaseError, connections, router, transaction
from django.db.migrations.loader import MigrationLoader
from django.db.models import Model
from django.utils import timezone

from django_idempotency.conf import conf
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.operations.verify.results import (
    APP_LABEL,
    Report,
    Result,
    error_summary,
    guarded,
)
from django_idempotency.operations.verify.scratch import PATH, Scratch

__all__ = ["configured"]


def _aliases() -> dict[str, list[type[Model]]]:
    """Each database the app's models are routed to, with those models."""
    found: dict[str, list[type[Model]]] = {}
    for model in (IdempotencyRecord, OutboxEvent, ProcessedMessage):
        found.setdefault(router.db_for_write(model), []).append(model)
    return found


def configured(report: Report, scratch: Scratch) -> bool:
    """Run the configuration checks into ``report``; whether the other checks can run."""
    checks = _system_checks()
    report.results.append(checks)
    databases = guarded("databases: migrated, writable", lambda: _databases(scratch))
    report.results.append(databases)
    cache_result, blocking = _cache_alias()
    report.results.append(cache_result)
    return checks.passed is not False and databases.passed is not False and not blocking


def _system_checks() -> Result:
    from django.core.checks import ERROR, run_checks

    name = "system checks (django_idempotency)"
    try:
        messages = [
            message
            for message in run_checks(include_deployment_checks=False)
            if str(message.id or "").startswith(f"{APP_LABEL}.")
        ]
    except Exception as exc:
        return Result(name, False, f"the checks could not run: {error_summary(exc)}")
    errors = [message for message in messages if message.level >= ERROR]
    warnings = sorted(
        {str(message.id).rpartition(".")[2] for message in messages}
        - {str(message.id).rpartition(".")[2] for message in errors}
    )
    if errors:
        described = "; ".join(f"{message.id}: {message.msg}" for message in errors)
        return Result(name, False, f"{described} (see manage.py check)")
    return Result(
        name, True, f"no errors; warnings: {', '.join(warnings)}" if warnings else "none raised"
    )


def _databases(scratch: Scratch) -> Result:
    name = "databases: migrated, writable"
    problems: list[str] = []
    seen: list[str] = []
    for alias, models in _aliases().items():
        connection = connections[alias]
        label = f"{alias!r} ({connection.vendor})"
        try:
            connection.ensure_connection()
        except Exception as exc:
            problems.append(f"database {label} is unreachable: {error_summary(exc)}")
            continue
        missing = _unapplied(alias)
        if missing:
            problems.append(
                f"database {label} lacks {len(missing)} migration(s) of {APP_LABEL} "
                f"({', '.join(missing)}): run `manage.py migrate {APP_LABEL} --database {alias}`"
            )
            continue
        for model in models:
            try:
                _write_probe(model, alias, scratch)
            except DatabaseError as exc:
                problems.append(f"database {label} refuses writes: {error_summary(exc)}")
                break
        else:
            names = ", ".join(model.__name__ for model in models)
            seen.append(f"{label}: {names}")
    if problems:
        return Result(name, False, "; ".join(problems))
    return Result(name, True, "migrated and writable: " + "; ".join(seen))


def _unapplied(alias: str) -> list[str]:
    loader = MigrationLoader(connections[alias], ignore_no_migrations=True)
    leaves = loader.graph.leaf_nodes(APP_LABEL)
    plan = [node for leaf in leaves for node in loader.graph.forwards_plan(leaf)]
    return sorted(
        {
            name
            for app, name in plan
            if app == APP_LABEL and (app, name) not in loader.applied_migrations
        }
    )


def _write_probe(model: type[Model], alias: str, scratch: Scratch) -> None:
    """Insert a scratch row and roll it back: a read-only database refuses here."""
    now = timezone.now()
    row: Model
    if model is ProcessedMessage:
        row = ProcessedMessage(consumer=scratch.scope, message_id="write-probe", processed_at=now)
    elif model is OutboxEvent:
        row = OutboxEvent(
            topic=f"{scratch.topic}.probe", payload={}, created_at=now, next_attempt_at=now
        )
    else:
        row = IdempotencyRecord(
            scope=scratch.scope,
            key=scratch.key("write-probe"),
            fingerprint="",
            owner_token=uuid.uuid4(),
            method="POST",
            path=PATH,
            created_at=now,
            expires_at=now,
        )
    with transaction.atomic(using=alias):
        row.save(using=alias)
        transaction.set_rollback(True, using=alias)


def _cache_alias() -> tuple[Result, bool]:
    """The Redis copy's cache, and whether its problem stops every request (a Redis that does
    not answer does not: requests fall back to the database)."""
    name = "Redis copy configuration"
    alias = conf.CACHE_ALIAS
    if alias is None:
        return Result(name, None, "CACHE_ALIAS is None: the database answers every request"), False
    caches = getattr(settings, "CACHES", {})
    if alias not in caches:
        known = ", ".join(map(repr, caches)) or "none"
        problem = f"IDEMPOTENCY['CACHE_ALIAS'] = {alias!r} is not an alias in CACHES ({known})"
        return Result(name, False, f"{problem}: name one, or set it to None"), True
    try:
        from django_redis import get_redis_connection
    except ImportError:
        return Result(name, False, "django-redis is not installed: pip install django-redis"), True
    try:
        get_redis_connection(alias).ping()
    except NotImplementedError:
        return Result(name, False, f"CACHES[{alias!r}] is not a django-redis cache"), True
    except Exception as exc:
        problem = f"Redis at CACHES[{alias!r}] does not answer: {error_summary(exc)}"
        return Result(name, False, problem), False
    return Result(name, True, f"CACHES[{alias!r}] answers PING"), False
