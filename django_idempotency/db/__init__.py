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

__all__ = ["database_now", "dialect", "to_datetime"]


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
