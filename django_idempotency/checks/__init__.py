"""System checks, declared as a table: one :class:`Check` row per id.

Each row holds its id, the condition that finds the problem, the message and the hint. The ids
are stable and never reused once retired (:mod:`.ids`); ``docs/checks.md`` documents each one
with its fix. :func:`register_all` hands every row to Django's check framework from
``AppConfig.ready()``, so ``manage.py check`` (and ``runserver``, ``migrate``, the test runner)
runs them with their tags.

The rows live with their group: :mod:`.request` (the request layer's settings, and the project
around it), :mod:`.outbox` (the outbox and its consumers), :mod:`.caches` (the Redis copy and
the answers kept in memory), :mod:`.operations` (admin, metrics, tracing), :mod:`.partitions`,
:mod:`.database` (the app's tables) and :mod:`.deploy` (``check --deploy``); :mod:`.base` holds
what they are made of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core.checks import CheckMessage, register

from django_idempotency.checks.base import Check, Context, Finding, importable
from django_idempotency.checks.caches import CACHE_CHECKS
from django_idempotency.checks.database import DATABASE_CHECKS
from django_idempotency.checks.deploy import DEPLOY_CHECKS, RETRY_WINDOW_SECONDS
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
    E020,
    E021,
    E022,
    E023,
    E024,
    E025,
    E026,
    E027,
    E028,
    E040,
    E041,
    E042,
    E043,
    E044,
    E060,
    E080,
    E081,
    E082,
    E083,
    E084,
    W001,
    W002,
    W003,
    W004,
    W005,
    W006,
    W007,
    W008,
    W009,
    W010,
    W011,
    W020,
    W021,
    W022,
    W023,
    W024,
    W025,
    W026,
    W027,
    W040,
    W041,
    W060,
    W061,
    W062,
    W080,
    W081,
)
from django_idempotency.checks.operations import OPERATIONS_CHECKS
from django_idempotency.checks.outbox import OUTBOX_CHECKS
from django_idempotency.checks.partitions import PARTITION_CHECKS, record_layout
from django_idempotency.checks.request import (
    MIDDLEWARE,
    PROJECT_CHECKS,
    SETTINGS_CHECKS,
    server_threads,
)

__all__ = [
    "BY_ID",
    "CACHE_CHECKS",
    "CHECKS",
    "Check",
    "Context",
    "DEPLOY_CHECKS",
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
    "E019",
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
    "W011",
    "W020",
    "W021",
    "W022",
    "W023",
    "W024",
    "W025",
    "W026",
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
    "record_layout",
    "register_all",
    "server_threads",
]

#: Helpers that tests patch on this package (:class:`_Package` passes the patch on).

#: The tables' checks: their partitions, and whether the database has them at all.
STORAGE_CHECKS: tuple[Check, ...] = (*PARTITION_CHECKS, *DATABASE_CHECKS)

#: Every check, in the order ``manage.py check`` reports them.
CHECKS: tuple[Check, ...] = (
    *SETTINGS_CHECKS,
    *PROJECT_CHECKS,
    *OUTBOX_CHECKS,
    *CACHE_CHECKS,
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
