"""Checks of the day-partitioned records, outbox and inbox tables: the settings, a database that
is not PostgreSQL, a table whose layout and setting disagree, the next partition missing
(E080-E083, W080, W081)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

from django.core.checks import Tags

from django_idempotency.checks.base import (
    Check,
    Context,
    Finding,
    _bad_numbers,
    _integer,
    _not_booleans,
)
from django_idempotency.checks.ids import E080, E081, E082, E083, W080, W081
from django_idempotency.conf import BOOLEAN_MESSAGE, parse_bool
from django_idempotency.exceptions import IdempotencyConfigurationError

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


PARTITION_CHECKS: tuple[Check, ...] = (
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
)
