"""The lease rule, written once in each of the three forms it is judged in: Python, the ORM, SQL.

A key is *held* while the request that claimed it (PROCESSING), or the worker it handed its work
to (ACCEPTED), has a lease that has not run out. A held key whose lease ran out is *run out*:
its request died or overran (a "stuck" key, taken over by the next retry). A record is *expired*
past its TTL, unless held: a slow request keeps its record however old it is. The state machine,
the record store, the claim statement, attach, the admin, the health page and the partitions'
retention all ask these questions here.

Every form is judged by the database's clock: the Python form with a time read from the database
(``db.database_now``), the ORM form with ``Now()`` unless given that time, the SQL form with the
dialect's ``NOW`` (or a time the statement was given). A web server whose clock is off never
judges a lease differently from the claim. ``tests/core/test_statemachine.py`` holds the forms
equal.

This is the one module of ``core`` that imports anything of Django's: its query expressions, so
that the rule's three forms sit side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.db.models import Q
from django.db.models.expressions import Combinable
from django.db.models.functions import Now

from django_idempotency.core.statuses import HELD

__all__ = [
    "expired",
    "expired_q",
    "expired_sql",
    "run_out_q",
    "run_out_sql",
    "running",
    "running_q",
    "running_sql",
]

#: A moment in the ORM form: a time read from the database, or (None) the database's ``NOW()``.
Moment = datetime | Combinable | None
#: A column's SQL reference, by the field's name (``"status"`` -> ``r."status"``).
Column = Callable[[str], str]


# --- Python ------------------------------------------------------------------------------------


def running(status: str, lease_expires_at: datetime | None, now: datetime) -> bool:
    """Held: PROCESSING or ACCEPTED with a lease that has not run out at ``now``."""
    return status in HELD and lease_expires_at is not None and lease_expires_at > now


def expired(
    status: str, lease_expires_at: datetime | None, expires_at: datetime, now: datetime
) -> bool:
    """Past its TTL and not held: a claim treats the record as absent, the sweep deletes it."""
    return expires_at <= now and not running(status, lease_expires_at, now)


# --- the ORM -----------------------------------------------------------------------------------


def _at(now: Moment) -> datetime | Combinable:
    return Now() if now is None else now


def running_q(now: Moment = None) -> Q:
    """:func:`running` as a filter."""
    return Q(status__in=HELD, lease_expires_at__isnull=False, lease_expires_at__gt=_at(now))


def run_out_q(now: Moment = None) -> Q:
    """Held, and its lease not running: run out, or none at all (a "stuck" key)."""
    return Q(status__in=HELD) & (
        Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=_at(now))
    )


def expired_q(now: Moment = None) -> Q:
    """:func:`expired` as a filter."""
    at = _at(now)
    return Q(expires_at__lte=at) & (
        ~Q(status__in=HELD) | Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=at)
    )


# --- SQL ---------------------------------------------------------------------------------------

_HELD_SQL = "(" + ", ".join(f"'{status}'" for status in HELD) + ")"


def running_sql(column: Column, now: str) -> str:
    """:func:`running` as an SQL condition; ``now`` is SQL (the dialect's ``NOW``)."""
    lease = column("lease_expires_at")
    return f"({column('status')} IN {_HELD_SQL} AND {lease} IS NOT NULL AND {lease} > {now})"


def run_out_sql(column: Column, now: str) -> str:
    """:func:`run_out_q` as an SQL condition."""
    lease = column("lease_expires_at")
    return f"({column('status')} IN {_HELD_SQL} AND ({lease} IS NULL OR {lease} <= {now}))"


def expired_sql(column: Column, now: str) -> str:
    """:func:`expired` as an SQL condition."""
    return f"({column('expires_at')} <= {now} AND NOT {running_sql(column, now)})"
