"""A model's rows in hand-written SQL: its columns, quoted and in order, and instances built from
what a raw cursor returned.

Where one statement does what the ORM would do in several (a claim, an acknowledgement, a read
that returns the database's time with the row), the cursor hands back the driver's values:
SQLite's timestamps as text, JSON as text. The ORM runs each field's converters before it
builds an instance; :func:`from_row` runs the same ones, so an instance read this way equals one
the ORM read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar, cast

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field, Model, signals
from django.db.models.base import ModelState

__all__ = ["attnames", "concrete_fields", "from_row", "from_rows", "quoted_column", "quoted_table"]

_M = TypeVar("_M", bound=Model)


@functools.cache
def concrete_fields(model: type[Model]) -> tuple[Field[Any, Any], ...]:
    """The model's concrete fields in column order: what a statement selects for
    :func:`from_row`, in that order."""
    return tuple(model._meta.concrete_fields)


@functools.cache
def attnames(model: type[Model]) -> tuple[str, ...]:
    """The attribute names of :func:`concrete_fields`. Known from the statement's text, so never
    read from ``cursor.description``, which builds a column object, its type looked up, for
    every column of every read."""
    return tuple(field.attname for field in concrete_fields(model))


def from_row(model: type[_M], using: str, values: Sequence[Any]) -> _M:
    """An instance from its concrete columns (in :func:`concrete_fields` order) as a cursor on
    ``using`` returned them, each converted as the ORM converts it."""
    return from_rows(model, using, [values])[0]


def from_rows(model: type[_M], using: str, rows: Iterable[Sequence[Any]]) -> list[_M]:
    """:func:`from_row` for each of ``rows``.

    A relay builds hundreds of instances per claim. ``Model.__init__`` sets each field through
    ``setattr`` and sends ``pre_init`` and ``post_init``; where that would change nothing (no
    receiver of either, no field whose attribute has a setter, ``from_db`` and ``__init__`` the
    model's own), the instances are built by filling their ``__dict__``, the same state in a
    fifth of the time.
    """
    connection = connections[using]
    # Only the columns that have converters (JSON, and timestamps on SQLite): most of a
    # batch's columns arrive ready.
    converting = _converters(model, using)
    names = attnames(model)
    plain = _plain(model) and not (
        signals.pre_init.has_listeners(model) or signals.post_init.has_listeners(model)
    )
    instances = []
    for values in rows:
        converted = list(values)
        for index, column, converters in converting:
            value = converted[index]
            for convert in converters:
                value = convert(value, column, connection)
            converted[index] = value
        if plain and len(converted) == len(names):
            instance = model.__new__(model)
            instance.__dict__.update(zip(names, converted, strict=True))
            instance._state = state = ModelState()
            state.adding, state.db = False, using
        else:
            instance = model.from_db(using, names, converted)
        instances.append(instance)
    return instances


@functools.cache
def _plain(model: type[Model]) -> bool:
    """Whether filling an instance's ``__dict__`` builds what ``from_db`` builds, receivers of
    the init signals aside."""
    return (
        model.__init__ is Model.__init__
        and model.from_db.__func__ is Model.from_db.__func__  # type: ignore[attr-defined]
        and not any(hasattr(getattr(model, name, None), "__set__") for name in attnames(model))
    )


@functools.lru_cache(maxsize=32)
def _converters(model: type[Model], using: str) -> list[tuple[int, Any, list[Any]]]:
    """Per concrete column that has any, its position, and the ORM's converters for values
    read on this connection."""
    connection = connections[using]
    table = model._meta.db_table
    result = []
    for index, field in enumerate(concrete_fields(model)):
        column = field.get_col(table)
        converters = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
        if converters:
            result.append((index, column, converters))
    return result


def quoted_table(connection: BaseDatabaseWrapper, model: type[Model]) -> str:
    return str(connection.ops.quote_name(model._meta.db_table))


def quoted_column(
    connection: BaseDatabaseWrapper, model: type[Model], field: str | Field[Any, Any]
) -> str:
    """A column, named by its field or the field's name, quoted for ``connection``."""
    if isinstance(field, str):
        field = cast("Field[Any, Any]", model._meta.get_field(field))
    return str(connection.ops.quote_name(cast(str, field.column)))
