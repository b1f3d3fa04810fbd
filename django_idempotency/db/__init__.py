"""Database helpers below every layer: batch iteration, and the SQL that differs per backend.

Each backend family has one module (``postgresql``, ``mysql``, ``sqlite``) with the same names
for what they share: ``NOW`` (the database's current time, in UTC, as SQL) and ``now_plus``.
:func:`dialect` picks the module for a connection; :func:`database_now` asks the database its
time, which is the only clock leases are measured by.
"""

from __future__ import annotations

from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from django.db import connections
from django.utils.dateparse import parse_datetime

from django_idempotency.db import mysql, postgresql, sqlite
from django_idempotency.exceptions import IdempotencyConfigurationError

__all__ = ["database_now", "dialect", "schema_missing", "to_datetime"]

#: How each backend says a table or column does not exist: PostgreSQL's SQLSTATEs
#: (undefined_table, undefined_column), MySQL's and MariaDB's error numbers (ER_NO_SUCH_TABLE,
#: ER_BAD_FIELD_ERROR) and SQLite's words.
_UNDEFINED_SQLSTATES = frozenset({"42P01", "42703"})
_UNDEFINED_MYSQL_ERRORS = frozenset({1146, 1054})
_UNDEFINED_SQLITE_WORDS = ("no such table", "no such column", "has no column named")


def dialect(using: str) -> ModuleType:
    """The SQL module of the connection's backend family."""
    vendor = connections[using].vendor
    modules = {"postgresql": postgresql, "mysql": mysql, "sqlite": sqlite}
    try:
        return modules[vendor]
    except KeyError:
        raise IdempotencyConfigurationError(
            f"django-idempotency supports PostgreSQL, MariaDB/MySQL and SQLite; the database "
            f"{using!r} is {vendor!r}. Route the app's models to a supported database with "
            f"DATABASE_ROUTERS."
        ) from None


def database_now(using: str) -> datetime:
    """The database's current time: what every lease, takeover and expiry is judged by."""
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {dialect(using).NOW}", [])
        return to_datetime(cursor.fetchone()[0])


def to_datetime(value: Any) -> datetime:
    """An aware UTC datetime from what a driver returned for a UTC timestamp."""
    if isinstance(value, str):  # SQLite
        parsed = parse_datetime(value)
        if parsed is None:
            raise ValueError(f"not a timestamp: {value!r}")
        value = parsed
    if not isinstance(value, datetime):
        raise TypeError(f"not a timestamp: {value!r}")
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def schema_missing(error: BaseException) -> bool:
    """Whether a database error says a table or column does not exist: on the app's own
    statements, that its migrations have not been applied to that database."""
    cause = error.__cause__ if isinstance(error.__cause__, Exception) else error
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if sqlstate is not None:
        return str(sqlstate) in _UNDEFINED_SQLSTATES
    args = getattr(cause, "args", ())
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        return args[0] in _UNDEFINED_MYSQL_ERRORS
    return any(words in str(cause) for words in _UNDEFINED_SQLITE_WORDS)
