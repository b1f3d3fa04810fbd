"""The check that the database has the app's tables and migrations (E084), run with
``check --database`` (but not by ``migrate``, which is about to apply them)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from django.core.checks import Tags

from django_idempotency.checks.base import Check, Context, Finding, _app_models
from django_idempotency.checks.ids import E084

_APP_LABEL = "django_idempotency"


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


DATABASE_CHECKS: tuple[Check, ...] = (
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
