"""Prepared statements on PostgreSQL, for the few statements every request runs.

Django's psycopg 3 cursors bind parameters on the client, so PostgreSQL parses and plans the
claim on every execution: most of a replay's time on the server (0.9 ms of a 1.2 ms replay in
one measurement). :func:`cursor` binds on the server instead and prepares each statement at its
first use on a connection; on a persistent connection (``CONN_MAX_AGE``) later executions only
bind and run. The statements it serves name their columns, so a migration that adds a column
does not invalidate what a long-lived connection prepared.

Prepared statements belong to the session: behind a pooler that does not keep sessions
(PgBouncer in transaction mode, before 1.21's ``max_prepared_statements``) turn
``PREPARED_STATEMENTS`` off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import conf

__all__ = ["cursor"]

#: A threshold no statement reaches: psycopg prepares nothing on a connection whose threshold
#: is None (Django's default), and with this one only the statements that ask are prepared.
_ONLY_WHEN_ASKED = 2**31 - 1


@contextmanager
def cursor(connection: BaseDatabaseWrapper) -> Iterator[Any]:
    """A cursor that prepares what it runs, wrapped as Django wraps its own (errors translated,
    queries logged when Django logs them); Django's ordinary cursor when the setting is off, on
    other backends, or on psycopg2."""
    if not (conf.PREPARED_STATEMENTS and connection.vendor == "postgresql" and _psycopg3()):
        with connection.cursor() as plain:
            yield plain
        return
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        raw = _open(connection)
    wrap = _wrappers().debug if connection.queries_logged else _wrappers().plain
    wrapped = wrap(raw, connection)
    connection.validate_thread_sharing()
    with wrapped:
        yield wrapped


def _psycopg3() -> bool:
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)


def _open(connection: BaseDatabaseWrapper) -> Any:
    from django.db.backends.postgresql.psycopg_any import register_tzloader
    from psycopg.postgres import types
    from psycopg.pq import Format

    raw = connection.connection
    if raw.prepare_threshold is None:
        raw.prepare_threshold = _ONLY_WHEN_ASKED
    opened = _wrappers().cursor(raw)
    # As Django's create_cursor(): timestamps read in the connection's time zone.
    loader = raw.adapters.get_loader(types["timestamptz"].oid, Format.TEXT)
    timezone = getattr(connection, "timezone", None)
    if timezone is not None and timezone != loader.timezone:
        register_tzloader(timezone, opened)
    return opened


class _Classes:
    def __init__(self, cursor: type, plain: type, debug: type) -> None:
        self.cursor, self.plain, self.debug = cursor, plain, debug


@cache
def _wrappers() -> _Classes:
    """The cursor and wrapper classes, built on first use: psycopg 3 may not be installed."""
    import psycopg
    from django.db.backends.postgresql.base import CursorDebugWrapper, CursorMixin
    from django.db.backends.utils import CursorWrapper

    class Preparing(CursorMixin, psycopg.Cursor):
        def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
            options.setdefault("prepare", True)
            return super().execute(query, params, **options)

    class Debug(CursorDebugWrapper):
        """Logs the statement with its values, as Django logs its own: psycopg keeps no text
        of a prepared execution for Django to read back."""

        def execute(self, sql: Any, params: Any = None) -> Any:
            with self.debug_sql(self.db.ops.compose_sql(sql, params)):
                return CursorWrapper.execute(self, sql, params)

    return _Classes(Preparing, CursorWrapper, Debug)
