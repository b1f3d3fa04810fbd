"""The relay's claim reads its rows' timestamps with a loader of its own
(``db.postgresql._iso_tzloader``, a tenth of the time psycopg's parser takes): it must give
exactly what Django's loader gives, in every session time zone, with and without ``USE_TZ``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from django_idempotency.db import postgresql

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's text timestamps"),
]

#: Instants whose text takes each shape: fractions or none, a half-hour offset, an offset
#: with seconds (local mean time, before 1911), the first year.
INSTANTS = [
    "2026-11-29 05:00:00.123456+00",
    "2026-03-29 01:30:00+00",
    "2026-06-01 12:00:00+00",
    "1900-01-01 12:00:00+00",
    "0001-01-02 00:00:00+00",
]


def read(ours: bool) -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        if ours:
            loader = postgresql._iso_tzloader(connection.timezone)
            cursor.cursor.adapters.register_loader("timestamptz", loader)
        cursor.execute("SELECT " + ", ".join(["%s::timestamptz"] * len(INSTANTS)), INSTANTS)
        row: tuple[Any, ...] = cursor.fetchone()
    return row


@pytest.mark.parametrize("use_tz", [True, False])
@pytest.mark.parametrize("zone", ["UTC", "Europe/Paris", "America/St_Johns"])
def test_the_claims_times_are_djangos(use_tz, zone):
    with override_settings(USE_TZ=use_tz):
        connection.close()  # opened again with this setting's session time zone
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET TIME ZONE %s", [zone])
            theirs, ours = read(ours=False), read(ours=True)
        finally:
            connection.close()
    assert all(isinstance(value, datetime) for value in ours)
    assert ours == theirs
    assert [value.tzinfo for value in ours] == [value.tzinfo for value in theirs]
    assert [value.isoformat() for value in ours] == [value.isoformat() for value in theirs]


def test_what_it_cannot_parse_gets_djangos_own_error():
    from django.db import DataError

    with connection.cursor() as cursor:
        cursor.cursor.adapters.register_loader(
            "timestamptz", postgresql._iso_tzloader(connection.timezone)
        )
        cursor.execute("SELECT '0005-11-29 05:00:00+00 BC'::timestamptz")
        with pytest.raises(DataError, match="before year 1"):
            cursor.fetchone()
