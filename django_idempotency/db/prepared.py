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

import datetime
import json
from contextlib import AbstractContextManager
from functools import cache
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import conf

__all__ = ["cursor"]

#: A threshold no statement reaches: psycopg prepares nothing on a connection whose threshold
#: is None (Django's default), and with this one only the statements that ask are prepared.
_ONLY_WHEN_ASKED = 2**31 - 1
_JSON_DECODER = json.JSONDecoder()


def cursor(connection: BaseDatabaseWrapper, *, binary: bool = False) -> AbstractContextManager[Any]:
    """A cursor that prepares what it runs, wrapped as Django wraps its own (errors translated,
    queries logged when Django logs them); Django's ordinary cursor when the setting is off, on
    other backends, or on psycopg2. Use it in a ``with`` block, as Django's own.

    The psycopg cursor underneath is kept with the connection and used again by its next
    statement, and so are its wrappers: opening one per statement (and giving it Django's time
    zone loader) cost more than binding and running a prepared replay. With ``binary``,
    results come back in PostgreSQL's binary format, which psycopg decodes without parsing
    text (timestamps, UUIDs, ``bytea``); ``jsonb`` then comes back decoded, where Django's
    text format gives a string.
    """
    if not (conf.PREPARED_STATEMENTS and connection.vendor == "postgresql" and _psycopg3()):
        return connection.cursor()
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        kept = _kept(connection, binary)
    connection.validate_thread_sharing()
    return kept.debug if connection.queries_logged else kept.plain


class _Lent(AbstractContextManager[Any]):
    """A kept cursor's wrapper, lent to one ``with`` block: never closed on the way out (a
    ``CursorWrapper``'s own ``__exit__`` would close it), since it is kept for the next one."""

    __slots__ = ("wrapper",)

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper

    def __enter__(self) -> Any:
        return self.wrapper

    def __exit__(self, *exc_info: object) -> None:
        return None


class _KeptCursor:
    """A psycopg cursor kept with its connection, and the two ways it is lent: plain, and
    logging its statements (when Django logs queries)."""

    __slots__ = ("debug", "plain")

    def __init__(self, raw: Any, connection: BaseDatabaseWrapper) -> None:
        self.plain = _Lent(_wrappers().plain(raw, connection))
        self.debug = _Lent(_wrappers().debug(raw, connection))


#: The connection wrapper's attribute that keeps its psycopg cursors: the raw connection, the
#: time zones they were opened for (Django's and the session's), and the cursors by format
#: (binary or not).
_KEPT = "_idempotency_prepared_cursors"


def _kept(connection: BaseDatabaseWrapper, binary: bool) -> _KeptCursor:
    """This connection's cursor for the format, opened again after a reconnection, a change
    of ``TIME_ZONE``/``USE_TZ`` or of the session's time zone (each replaces what the cursor
    was opened for)."""
    raw = connection.connection
    zones = (getattr(connection, "timezone", None), raw.pgconn.parameter_status(b"TimeZone"))
    kept = getattr(connection, _KEPT, None)
    if kept is None or kept[0] is not raw or kept[1] != zones:
        kept = (raw, zones, {})
        setattr(connection, _KEPT, kept)
    cursors: dict[bool, _KeptCursor] = kept[2]
    opened = cursors.get(binary)
    if opened is None:
        opened = cursors[binary] = _KeptCursor(_open(connection, binary), connection)
    return opened


@cache
def _psycopg3() -> bool:
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)


def _open(connection: BaseDatabaseWrapper, binary: bool) -> Any:
    from django.db.backends.postgresql.psycopg_any import register_tzloader
    from psycopg.postgres import types
    from psycopg.pq import Format

    raw = connection.connection
    if raw.prepare_threshold is None:
        raw.prepare_threshold = _ONLY_WHEN_ASKED
    opened = _wrappers().cursor(raw)
    timezone = getattr(connection, "timezone", None)
    if binary:
        from psycopg.types.json import set_json_loads

        opened.format = Format.BINARY
        set_json_loads(_json_loads, opened)
        # Django registers its time zone loader for the text format only: without one,
        # timestamps would come back aware in the session's zone even where Django gives
        # naive ones (USE_TZ = False).
        if not _psycopg_gives_djangos_times(raw, timezone):
            opened.adapters.register_loader("timestamptz", _binary_tzloader(timezone))
        return opened
    # As Django's create_cursor(): timestamps read in the connection's time zone.
    loader = raw.adapters.get_loader(types["timestamptz"].oid, Format.TEXT)
    if timezone != loader.timezone:
        register_tzloader(timezone, opened)
    return opened


def _json_loads(data: str | bytes) -> Any:
    """``json.loads`` for what PostgreSQL sends a Django connection, always UTF-8, without
    sniffing the bytes' encoding first: a replay from the database reads its stored headers
    through it, and so does every claim."""
    return _JSON_DECODER.decode(data.decode() if isinstance(data, bytes) else data)


def _psycopg_gives_djangos_times(raw: Any, timezone: Any) -> bool:
    """Whether psycopg's own binary timestamp loader already gives what Django's gives: where
    both zones are UTC (Django's default), since psycopg reads a session in UTC as
    ``datetime.UTC``. Its loader is then kept: ten times faster than one written in Python."""
    return timezone is datetime.UTC and raw.pgconn.parameter_status(b"TimeZone") == b"UTC"


@cache
def _binary_tzloader(timezone: Any) -> type:
    """psycopg's binary timestamp loader, giving what Django's text one gives: the time in the
    connection's zone, naive where it has none (``USE_TZ = False``)."""
    from psycopg.types.datetime import TimestamptzBinaryLoader

    class Loader(TimestamptzBinaryLoader):
        def load(self, data: Any) -> Any:
            return super().load(data).replace(tzinfo=timezone)

    return Loader


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
