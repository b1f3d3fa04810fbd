"""Day partitions on PostgreSQL of the idempotency records (``RECORD_PARTITIONS``), the outbox
events (``OUTBOX_PARTITIONS``) and the inbox markers (``INBOX_PARTITIONS``): one machinery, a
:class:`Layout` per table.

The layout: the records table is partitioned by range on ``created_at`` (the claim's database
time), one partition per ``PARTITION_SPAN_DAYS`` days, aligned on UTC midnights, named
``<table>_p<YYYYMMDD>`` after its first day. There is no default partition: a claim whose time
no partition covers fails (:class:`~django_idempotency.exceptions.PartitionMissing`) instead of
landing somewhere retention would later drop unseen. Each partition carries its own primary key
``(id)`` and unique ``(scope, key)``; the parent has neither (PostgreSQL requires the partition
column in a partitioned table's unique indexes), and uniqueness across partitions is the claim's
key lock (``db/postgresql.py``, ``KEY_LOCK_STEP``). The model's other indexes are partitioned
indexes on the parent, under the model's names. The outbox is laid out the same way on its own
``created_at``; each partition carries unique ``(event_id)``, and an event id given to
``publish()`` is checked across partitions under its lock (``outbox/publish.py``). The inbox
is partitioned on ``processed_at``; each partition carries unique ``(consumer, message_id)``,
and a consumer marks a message under that pair's lock (``db/postgresql.py``,
``INBOX_LOCK_STATEMENT``, ``insert_marker(partitioned=True)``).

Each function takes the table's layout, :data:`RECORDS` (the default), :data:`OUTBOX` or
:data:`INBOX`.

Three operations, each a plain function the management command and the Celery task call:

* :func:`create_partitions`: the partitions from today's to ``PARTITION_AHEAD_DAYS`` ahead.
* :func:`apply_retention`: detach and drop each partition whose every row is past its
  retention, and refuse (naming it and its live rows) a partition that still holds a live one:
  an unexpired or leased record; an event PENDING, DEAD, or published within
  ``OUTBOX_RETENTION_SECONDS``; a marker within ``INBOX_RETENTION_SECONDS``.
* :func:`partition_table` / :func:`unpartition_table`: the migration from the plain table and
  back (docs/partitions.md states the downtime of each).

Every DDL statement runs with ``lock_timeout`` (:data:`LOCK_TIMEOUT`): a statement that needs
the parent's ACCESS EXCLUSIVE lock waits behind long transactions, and while it waits, every
claim queues behind it; giving up and trying again later is cheaper than that queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections, models, router, transaction
from django.db.models.sql import Query
from django.utils.dateparse import parse_datetime

from django_idempotency.conf import conf
from django_idempotency.core import leases
from django_idempotency.db import database_now
from django_idempotency.db.indexes import extra_indexes
from django_idempotency.db.postgresql import OUTBOX_STORAGE, storage_parameters
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage

__all__ = [
    "EPOCH",
    "INBOX",
    "LEGACY_SUFFIX",
    "LAYOUTS",
    "LOCK_TIMEOUT",
    "OUTBOX",
    "RECORDS",
    "Layout",
    "Partition",
    "RetentionOutcome",
    "apply_retention",
    "create_partition",
    "create_partitions",
    "is_partitioned",
    "live_counts",
    "live_rows",
    "maintain",
    "partition_table",
    "partitions",
    "unpartition_table",
    "window_start",
]

logger = logging.getLogger(__name__)

#: Partitions are aligned on whole spans of days counted from here (UTC).
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The plain table, once attached as the first partition, is ``<table>_legacy``.
LEGACY_SUFFIX = "_legacy"
#: How long a DDL statement waits for its lock before it gives up (and is tried again).
LOCK_TIMEOUT = "5s"
#: Tries of a DDL transaction that timed out waiting for its lock.
LOCK_TRIES = 5


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition: its name and range (``start`` None: from MINVALUE, the legacy one)."""

    name: str
    start: datetime | None
    end: datetime


@dataclass(frozen=True, slots=True)
class RetentionOutcome:
    """What retention did with one partition old enough to drop."""

    partition: str
    #: ``"dropped"``, ``"refused"`` (it holds live records) or ``"due"`` (a dry run).
    action: str
    #: Live rows found in it (only when refused).
    live: int = 0
    #: The live rows by kind, for the message: ``"2 PENDING, 1 DEAD"`` (only when refused).
    detail: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Layout:
    """What differs between the partitioned tables; everything else is shared."""

    #: ``"records"``, ``"outbox"`` or ``"inbox"``: the command's ``--table``.
    label: str
    #: The setting that turns the layout on.
    setting: str
    model: type[models.Model]
    #: Each partition's unique constraint: its name's suffix and its fields.
    unique_suffix: str
    unique_fields: tuple[str, ...]
    #: The setting holding how long a row stays after it stopped mattering (seconds).
    retention_setting: str
    #: The task that maintains it (named in messages).
    task: str
    #: What a live row is, for the command's refusal.
    live_rows: str
    #: The column the table is partitioned on.
    partition_column: str = "created_at"
    #: The storage parameters of each partition (``WITH (...)``); a partitioned parent has none.
    storage: str = ""

    def using(self) -> str:
        return router.db_for_write(self.model)

    @property
    def table(self) -> str:
        return self.model._meta.db_table

    @property
    def enabled(self) -> bool:
        return bool(getattr(conf, self.setting))

    @property
    def retention(self) -> timedelta:
        return timedelta(seconds=float(getattr(conf, self.retention_setting)))

    def column(self, name: str) -> str:
        return str(self.model._meta.get_field(name).column)  # type: ignore[union-attr]

    def indexes(self) -> tuple[models.Index, ...]:
        """The table's non-unique indexes: the model's ``Meta.indexes``, and those the app's
        migrations add beside them (``db/indexes.py``)."""
        return (*self.model._meta.indexes, *extra_indexes(self.model))

    def live(self, using: str, now: datetime) -> tuple[str, str, dict[str, Any]]:
        """The SQL that labels a live row (the kind it is counted as), the condition that
        finds the live rows, and the condition's parameters."""

        def col(name: str) -> str:
            return _quote(using, self.column(name))

        if self.model is OutboxEvent:
            # Unpublished (PENDING, DEAD), or published within the sweep's retention.
            label = (
                f"CASE WHEN {col('status')} = 'PUBLISHED' THEN 'published within retention' "
                f"ELSE {col('status')} END"
            )
            condition = (
                f"({col('status')} <> 'PUBLISHED' OR {col('published_at')} IS NULL "
                f"OR {col('published_at')} > %(since)s)"
            )
            return label, condition, {"since": now - self.retention}
        if self.model is ProcessedMessage:
            # A partition past the retention holds none; counted all the same.
            condition = f"{col('processed_at')} > %(since)s"
            return "'within retention'", condition, {"since": now - self.retention}
        # Not expired (``core/leases.py``): unexpired, or held under a running lease, judged at
        # ``now``, the database's time. Both halves are served by the model's indexes.
        at = "CAST(%(now)s AS timestamp with time zone)"
        return "'live'", f"NOT {leases.expired_sql(col, at)}", {"now": now}


RECORDS = Layout(
    label="records",
    setting="RECORD_PARTITIONS",
    model=IdempotencyRecord,
    unique_suffix="_scope_key_uniq",
    unique_fields=("scope", "key"),
    retention_setting="TTL_SECONDS",
    task="maintain_record_partitions",
    live_rows="live records (unexpired, or held under a running lease)",
)
OUTBOX = Layout(
    label="outbox",
    setting="OUTBOX_PARTITIONS",
    model=OutboxEvent,
    unique_suffix="_event_id_uniq",
    unique_fields=("event_id",),
    retention_setting="OUTBOX_RETENTION_SECONDS",
    task="maintain_outbox_partitions",
    live_rows="events that are not to be dropped yet",
    storage=f"WITH ({storage_parameters(OUTBOX_STORAGE)})",
)
INBOX = Layout(
    label="inbox",
    setting="INBOX_PARTITIONS",
    model=ProcessedMessage,
    # Short: the table's name and the partition's date leave 18 of PostgreSQL's 63 characters.
    unique_suffix="_uniq",
    unique_fields=("consumer", "message_id"),
    retention_setting="INBOX_RETENTION_SECONDS",
    task="maintain_inbox_partitions",
    live_rows="markers within the retention",
    partition_column="processed_at",
)
#: The layouts by ``label``.
LAYOUTS = {layout.label: layout for layout in (RECORDS, OUTBOX, INBOX)}


def _quote(using: str, name: str) -> str:
    return str(connections[using].ops.quote_name(name))


def _require_postgresql(using: str, layout: Layout) -> None:
    vendor = connections[using].vendor
    if vendor != "postgresql":
        raise IdempotencyConfigurationError(
            f"IDEMPOTENCY[{layout.setting!r}] needs PostgreSQL; the {layout.label} database "
            f"{using!r} is {vendor!r}. Keep the setting off there: the sweep "
            f"(idempotency_sweep) keeps the table small."
        )


def is_partitioned(using: str | None = None, layout: Layout = RECORDS) -> bool:
    """Whether the table is partitioned (always False off PostgreSQL)."""
    using = using or layout.using()
    if connections[using].vendor != "postgresql":
        return False
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)",
            [_quote(using, layout.table)],
        )
        row = cursor.fetchone()
    return row is not None and row[0] == "p"


def window_start(moment: datetime, span_days: int | None = None) -> datetime:
    """The start of the partition window that holds ``moment``."""
    span = timedelta(days=span_days or conf.PARTITION_SPAN_DAYS)
    return EPOCH + ((moment - EPOCH) // span) * span


def partition_name(start: datetime, layout: Layout = RECORDS) -> str:
    return f"{layout.table}_p{start.astimezone(UTC):%Y%m%d}"


def partitions(using: str | None = None, layout: Layout = RECORDS) -> list[Partition]:
    """The table's partitions, oldest first (the legacy one, from MINVALUE, before all)."""
    using = using or layout.using()
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT child.relname, pg_get_expr(child.relpartbound, child.oid) "
            "FROM pg_inherits JOIN pg_class child ON child.oid = pg_inherits.inhrelid "
            "WHERE pg_inherits.inhparent = to_regclass(%s)",
            [_quote(using, layout.table)],
        )
        rows = cursor.fetchall()
    found = []
    for name, bound in rows:
        # FOR VALUES FROM ('2026-01-01 00:00:00+00') TO ('2026-01-02 00:00:00+00')
        lower, upper = bound.split(" FROM (", 1)[1].split(") TO (", 1)
        start = None if lower == "MINVALUE" else _bound(lower)
        found.append(Partition(str(name), start, _bound(upper.rstrip(")"))))
    return sorted(found, key=lambda part: part.end)


def _bound(text: str) -> datetime:
    """A range bound as ``pg_get_expr`` prints it (in the session's time zone, UTC)."""
    parsed = parse_datetime(text.strip("'"))
    if parsed is None:
        raise ValueError(f"not a partition bound: {text!r}")
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@contextmanager
def _ddl(using: str) -> Iterator[Any]:
    """A transaction for DDL, with ``lock_timeout``: tried again a few times when it timed
    out waiting for a lock (callers pass a function; see :func:`_retrying`)."""
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [LOCK_TIMEOUT])
        yield cursor


def _retrying(using: str, work: Any) -> Any:
    """Run ``work(cursor)`` in a :func:`_ddl` transaction, again after a lock timeout."""
    from django.db import OperationalError

    for attempt in range(1, LOCK_TRIES + 1):
        try:
            with _ddl(using) as cursor:
                return work(cursor)
        except OperationalError as exc:
            if "lock timeout" not in str(exc) or attempt == LOCK_TRIES:
                raise
            logger.warning("partition DDL waited %s for a lock; trying again", LOCK_TIMEOUT)
            time.sleep(attempt)
    raise AssertionError("unreachable")  # pragma: no cover


def _partition_ddl(
    using: str, name: str, start: datetime, end: datetime, layout: Layout = RECORDS
) -> list[str]:
    table, part = _quote(using, layout.table), _quote(using, name)
    unique = ", ".join(_quote(using, layout.column(field)) for field in layout.unique_fields)
    return [
        f"CREATE TABLE {part} PARTITION OF {table} FOR VALUES FROM ('{start.isoformat()}') "
        f"TO ('{end.isoformat()}') {layout.storage}",
        f"ALTER TABLE {part} ADD CONSTRAINT {_quote(using, name + '_pkey')} "
        f"PRIMARY KEY ({_quote(using, layout.column('id'))}), "
        f"ADD CONSTRAINT {_quote(using, name + layout.unique_suffix)} UNIQUE ({unique})",
    ]


def create_partition(
    start: datetime,
    end: datetime,
    *,
    name: str | None = None,
    using: str | None = None,
    layout: Layout = RECORDS,
) -> str:
    """Create one partition ``[start, end)`` with its primary key and unique constraint
    (both empty, so instant). Takes the parent's ACCESS EXCLUSIVE lock for a moment."""
    using = using or layout.using()
    name = name or partition_name(start, layout)

    def work(cursor: Any) -> None:
        for statement in _partition_ddl(using, name, start, end, layout):
            cursor.execute(statement)

    _retrying(using, work)
    logger.info("created partition %s", name, extra={"partition": name})
    return name


def create_partitions(
    *,
    ahead_days: int | None = None,
    now: datetime | None = None,
    dry_run: bool = False,
    layout: Layout = RECORDS,
) -> list[str]:
    """Create the partitions from the one holding ``now`` (the database's time) to
    ``ahead_days`` (``PARTITION_AHEAD_DAYS``) ahead, where none covers them yet. Returns the
    names created (or that would be)."""
    using = layout.using()
    _require_postgresql(using, layout)
    if not is_partitioned(using, layout):
        raise IdempotencyConfigurationError(
            f"{layout.table} is not partitioned: run `manage.py idempotency_partitions "
            f"partition{_table_option(layout)}` first (docs/partitions.md)."
        )
    now = now or database_now(using)
    span = timedelta(days=conf.PARTITION_SPAN_DAYS)
    horizon = now + timedelta(days=conf.PARTITION_AHEAD_DAYS if ahead_days is None else ahead_days)
    existing = partitions(using, layout)
    covered_until = max((part.end for part in existing), default=None)
    start = window_start(now)
    if covered_until is not None and covered_until > start:
        start = covered_until
    created = []
    while start <= horizon:
        # A range left off the grid (a legacy bound between two midnights) ends at the next one.
        end = window_start(start) + span
        name = partition_name(start, layout)
        if not dry_run:
            create_partition(start, end, name=name, using=using, layout=layout)
        created.append(name)
        start = end
    return created


def _table_option(layout: Layout) -> str:
    return "" if layout is RECORDS else f" --table {layout.label}"


def live_counts(
    name: str, now: datetime, using: str | None = None, layout: Layout = RECORDS
) -> dict[str, int]:
    """The live rows the partition ``name`` holds at ``now``, by kind (``Layout.live``)."""
    using = using or layout.using()
    label, condition, params = layout.live(using, now)
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"SELECT {label}, count(*) FROM {_quote(using, name)} WHERE {condition} GROUP BY 1",
            params,
        )
        return {str(kind): int(count) for kind, count in cursor.fetchall()}


def live_rows(name: str, now: datetime, using: str | None = None, layout: Layout = RECORDS) -> int:
    """How many live rows the partition ``name`` holds at ``now``."""
    return sum(live_counts(name, now, using, layout).values())


def _detail(counts: dict[str, int]) -> str:
    """``"2 PENDING, 1 DEAD"``; nothing for the records, which have one kind of live row."""
    if set(counts) <= {"live"}:
        return ""
    return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))


def apply_retention(
    *, now: datetime | None = None, dry_run: bool = False, layout: Layout = RECORDS
) -> list[RetentionOutcome]:
    """Detach and drop every partition that ended more than its retention (``TTL_SECONDS``;
    ``OUTBOX_RETENTION_SECONDS``) ago and holds no live row (what the sweep would delete, all
    of it). A partition that still holds one is refused, logged at WARNING with its name and
    counts, and left for a later run.

    Each drop is one short transaction: the parent is locked (ACCESS EXCLUSIVE, as the detach
    needs; taken first, in the order claims take their locks), the live rows are counted under
    that lock (an owner completing an old record, or a relay retrying a DEAD event, cannot
    revive it meanwhile), then the partition is detached, and dropped once detached. Claims
    and relays wait for the moment it takes.
    """
    using = layout.using()
    _require_postgresql(using, layout)
    now = now or database_now(using)
    cutoff = now - layout.retention
    outcomes = []
    for part in partitions(using, layout):
        if part.end > cutoff:
            continue
        if dry_run:
            counts = live_counts(part.name, now, using, layout)
            live = sum(counts.values())
            outcomes.append(
                RetentionOutcome(part.name, "refused" if live else "due", live, _detail(counts))
            )
            continue
        outcomes.append(_drop_if_dead(using, part, now, layout))
    return outcomes


def _drop_if_dead(using: str, part: Partition, now: datetime, layout: Layout) -> RetentionOutcome:
    table, name = _quote(using, layout.table), _quote(using, part.name)

    def work(cursor: Any) -> dict[str, int]:
        cursor.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        counts = live_counts(part.name, now, using, layout)
        if counts:
            return counts
        cursor.execute(f"ALTER TABLE {table} DETACH PARTITION {name}")
        cursor.execute(f"DROP TABLE {name}")
        return {}

    counts: dict[str, int] = _retrying(using, work)
    if counts:
        live = sum(counts.values())
        logger.warning(
            "retention refused to drop partition %s: it holds %d live rows (%s)",
            part.name,
            live,
            _detail(counts),
            extra={"partition": part.name, "live_records": live, "live_by_kind": counts},
        )
        return RetentionOutcome(part.name, "refused", live, _detail(counts))
    logger.info("dropped partition %s", part.name, extra={"partition": part.name})
    return RetentionOutcome(part.name, "dropped")


def maintain(*, dry_run: bool = False, layout: Layout = RECORDS) -> dict[str, Any]:
    """What the hourly task and ``idempotency_partitions maintain`` do: create the partitions
    ahead, then apply retention. Nothing (``{"skipped": ...}``) unless the layout's setting
    (``RECORD_PARTITIONS``, ``OUTBOX_PARTITIONS``) is on and the table is partitioned, so the
    task can sit in every project's beat schedule."""
    using = layout.using()
    if not layout.enabled:
        return {"skipped": f"{layout.setting} is off"}
    if not is_partitioned(using, layout):
        logger.warning(
            "%s is on but %s is not partitioned: run "
            "`manage.py idempotency_partitions partition%s` (docs/partitions.md)",
            layout.setting,
            layout.table,
            _table_option(layout),
        )
        return {"skipped": f"the {layout.label} table is not partitioned"}
    created = create_partitions(dry_run=dry_run, layout=layout)
    outcomes = apply_retention(dry_run=dry_run, layout=layout)
    return {
        "created": created,
        "dropped": [outcome.partition for outcome in outcomes if outcome.action == "dropped"],
        "due": [outcome.partition for outcome in outcomes if outcome.action == "due"],
        "refused": {
            outcome.partition: outcome.live for outcome in outcomes if outcome.action == "refused"
        },
    }


# --- migration ---------------------------------------------------------------------------------


def _index_statements(using: str, table: str, layout: Layout) -> list[str]:
    """The table's non-unique indexes (:meth:`Layout.indexes`), on ``table``, under their
    names."""
    statements = []
    for index in layout.indexes():
        columns = ", ".join(_quote(using, layout.column(field)) for field in index.fields)
        included = ", ".join(_quote(using, layout.column(field)) for field in index.include)
        statements.append(
            f"CREATE INDEX {_quote(using, str(index.name))} ON {_quote(using, table)} ({columns})"
            + (f" INCLUDE ({included})" if included else "")
            + (f" WHERE {_condition(using, layout, index)}" if index.condition else "")
        )
    return statements


def _condition(using: str, layout: Layout, index: models.Index) -> str:
    """A partial index's condition as SQL, its values inlined (as Django's schema editor does)."""
    connection = connections[using]
    assert index.condition is not None
    query = Query(model=layout.model, alias_cols=False)
    sql, params = query.build_where(index.condition).as_sql(
        query.get_compiler(connection=connection), connection
    )
    editor = connection.schema_editor()
    return str(sql % tuple(editor.quote_value(param) for param in params))


def _next_id(cursor: Any, using: str, table: str, layout: Layout) -> int:
    """The next id ``table``'s identity would give (at least one past every id it holds)."""
    quoted = _quote(using, table)
    cursor.execute(
        "SELECT GREATEST("
        f"(SELECT COALESCE(max({_quote(using, layout.column('id'))}), 0) FROM {quoted}), "
        "COALESCE(pg_sequence_last_value(pg_get_serial_sequence(%s, %s)::regclass), 0)) + 1",
        [quoted, layout.column("id")],
    )
    return int(cursor.fetchone()[0])


def _legacy_index(legacy: str, index: str) -> str:
    # Both prefixes off, or the outbox's names pass PostgreSQL's 63 characters.
    return f"{legacy}_{index.removeprefix('django_idempotency_').removeprefix('django_idem_')}"


def _drop_check(using: str, check: str, layout: Layout) -> str:
    table = _quote(using, layout.table)
    return f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {_quote(using, check)}"


def default_bound(now: datetime) -> datetime:
    """Where the legacy partition ends: the first window boundary at least an hour away, so
    the steps before the swap have time to finish before claims cross it."""
    return window_start(now + timedelta(hours=1)) + timedelta(days=conf.PARTITION_SPAN_DAYS)


def partition_table(
    *,
    bound: datetime | None = None,
    ahead_days: int | None = None,
    verbose: Any = None,
    layout: Layout = RECORDS,
) -> datetime:
    """Move the plain table to the partitioned layout, writes continuing.

    1. A CHECK ``created_at < bound`` is added NOT VALID (a moment's lock), then validated
       (a scan that blocks no write); the ``lock_timeout`` applies to the first.
    2. One short transaction (metadata only, no row is read or copied): the plain table is
       renamed ``<table>_legacy`` (its model-named indexes too), a partitioned parent takes the
       table's name, columns, identity (continued from the plain table's) and indexes, the plain
       table is attached as its partition from MINVALUE to ``bound`` (the validated CHECK spares
       the scan), and the partitions from ``bound`` on are created.

    Claims must already run with ``RECORD_PARTITIONS`` on (their key lock; the plain table's
    unique constraint still holds meanwhile), and ``publish()`` with ``OUTBOX_PARTITIONS`` on
    (the event id's lock). The legacy partition is dropped by retention once all its rows are
    past their retention. Returns ``bound``.
    """
    using = layout.using()
    _require_postgresql(using, layout)
    if not layout.enabled:
        guarded = {RECORDS: "claims", OUTBOX: "publish() with an event_id"}.get(layout, "consumers")
        raise IdempotencyConfigurationError(
            f"Set IDEMPOTENCY[{layout.setting!r}] = True and deploy it to every process before "
            f"partitioning: without it {guarded} rely on the unique constraint on "
            f"({', '.join(layout.unique_fields)}), which a partitioned table keeps only within "
            "each partition."
        )
    if is_partitioned(using, layout):
        raise IdempotencyConfigurationError(f"{layout.table} is partitioned already.")
    say = verbose or (lambda message: None)
    now = database_now(using)
    bound = bound or default_bound(now)
    table = layout.table
    legacy = f"{table}{LEGACY_SUFFIX}"
    check = f"{legacy}_bound"
    qtable, qlegacy = _quote(using, table), _quote(using, legacy)
    created_at = _quote(using, layout.column(layout.partition_column))

    def add_check(cursor: Any) -> None:
        # A run killed between this step and the swap may have left its CHECK: replaced.
        cursor.execute(
            f"ALTER TABLE {qtable} DROP CONSTRAINT IF EXISTS {_quote(using, check)}, "
            f"ADD CONSTRAINT {_quote(using, check)} "
            f"CHECK ({created_at} < '{bound.isoformat()}') NOT VALID"
        )

    def swap(cursor: Any) -> None:
        cursor.execute(f"LOCK TABLE {qtable} IN ACCESS EXCLUSIVE MODE")
        next_id = _next_id(cursor, using, table, layout)
        cursor.execute(f"ALTER TABLE {qtable} RENAME TO {qlegacy}")
        for index in layout.indexes():
            cursor.execute(
                f"ALTER INDEX {_quote(using, str(index.name))} "
                f"RENAME TO {_quote(using, _legacy_index(legacy, str(index.name)))}"
            )
        cursor.execute(
            f"CREATE TABLE {qtable} (LIKE {qlegacy} INCLUDING DEFAULTS INCLUDING IDENTITY "
            f"INCLUDING STORAGE INCLUDING COMPRESSION) PARTITION BY RANGE ({created_at})"
        )
        cursor.execute(
            f"ALTER TABLE {qtable} ALTER COLUMN {_quote(using, layout.column('id'))} "
            f"RESTART WITH {next_id}"
        )
        for statement in _index_statements(using, table, layout):
            cursor.execute(statement)
        cursor.execute(
            f"ALTER TABLE {qtable} ATTACH PARTITION {qlegacy} "
            f"FOR VALUES FROM (MINVALUE) TO ('{bound.isoformat()}')"
        )
        end = window_start(bound) + timedelta(days=conf.PARTITION_SPAN_DAYS)
        for statement in _partition_ddl(using, partition_name(bound, layout), bound, end, layout):
            cursor.execute(statement)

    from django_idempotency.request.claims import create_claim_functions

    if layout is RECORDS:
        create_claim_functions(using)
        say("Created the claim functions.")
    _retrying(using, add_check)
    say(f"Added CHECK {check} ({created_at} < {bound.isoformat()}) NOT VALID.")
    try:
        started = time.monotonic()
        with connections[using].cursor() as cursor:
            cursor.execute(f"ALTER TABLE {qtable} VALIDATE CONSTRAINT {_quote(using, check)}")
        say(f"Validated it in {time.monotonic() - started:.2f} s (writes continued).")

        started = time.monotonic()
        _retrying(using, swap)
        say(f"Swapped in the partitioned table in {time.monotonic() - started:.3f} s.")
    except BaseException:
        # Left behind, the CHECK would refuse every claim once the database's clock passed the
        # bound. (The swap is one transaction: it happened entirely or not at all.)
        if not is_partitioned(using, layout):
            _retrying(using, lambda cursor: cursor.execute(_drop_check(using, check, layout)))
        raise
    create_partitions(ahead_days=ahead_days, layout=layout)
    return bound


def unpartition_table(*, verbose: Any = None, layout: Layout = RECORDS) -> float:
    """Move the partitioned table back to one plain table; returns the seconds writes
    were stopped.

    One transaction: the parent is locked (ACCESS EXCLUSIVE: claims and reads wait), every row
    is copied into a new plain table, the partitioned table is dropped, the new one
    takes its name, its identity (continued), primary key, unique constraints and indexes
    under the model's names. Claims (or publishing) wait for the whole copy
    (docs/partitions.md gives the time per million rows); turn the setting off once it is done.
    """
    using = layout.using()
    _require_postgresql(using, layout)
    if not is_partitioned(using, layout):
        raise IdempotencyConfigurationError(f"{layout.table} is not partitioned.")
    say = verbose or (lambda message: None)
    table = layout.table
    copy = f"{table}_unpartitioning"
    qtable, qcopy = _quote(using, table), _quote(using, copy)
    id_column = _quote(using, layout.column("id"))

    def work(cursor: Any) -> float:
        # ACCESS EXCLUSIVE from the start, though the copy only needs writes stopped: a claim
        # holding ACCESS SHARE (its lookup) and then asking ROW EXCLUSIVE (its write) would
        # deadlock with the DROP below, which needs ACCESS EXCLUSIVE.
        cursor.execute(f"LOCK TABLE {qtable} IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        cursor.execute(
            f"CREATE TABLE {qcopy} (LIKE {qtable} INCLUDING DEFAULTS INCLUDING IDENTITY "
            f"INCLUDING STORAGE INCLUDING COMPRESSION) {layout.storage}"
        )
        cursor.execute(f"INSERT INTO {qcopy} OVERRIDING SYSTEM VALUE SELECT * FROM {qtable}")
        next_id = _next_id(cursor, using, table, layout)
        cursor.execute(f"DROP TABLE {qtable}")
        cursor.execute(f"ALTER TABLE {qcopy} RENAME TO {qtable}")
        cursor.execute(f"ALTER TABLE {qtable} ALTER COLUMN {id_column} RESTART WITH {next_id}")
        cursor.execute(
            f"ALTER TABLE {qtable} ADD CONSTRAINT {_quote(using, table + '_pkey')} "
            f"PRIMARY KEY ({id_column})"
        )
        for constraint in layout.model._meta.constraints:
            fields = getattr(constraint, "fields", ())
            columns = ", ".join(_quote(using, layout.column(field)) for field in fields)
            cursor.execute(
                f"ALTER TABLE {qtable} ADD CONSTRAINT {_quote(using, constraint.name)} "
                f"UNIQUE ({columns})"
            )
        for statement in _index_statements(using, table, layout):
            cursor.execute(statement)
        return time.monotonic() - started

    seconds = float(_retrying(using, work))
    say(f"Copied {table} into a plain table; writes waited {seconds:.2f} s.")
    return seconds
