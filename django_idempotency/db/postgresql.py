"""SQL that only PostgreSQL speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# --- idempotency records -----------------------------------------------------------------------

#: The database's time for this statement. PostgreSQL's ``now()`` is the transaction's start,
#: which inside a long transaction is not "now"; the statement's time is.
NOW = "STATEMENT_TIMESTAMP()"


def now_plus(seconds: float) -> tuple[str, list[Any]]:
    """The statement's time plus ``seconds``, as SQL and its parameters."""
    return f"({NOW} + make_interval(secs => %s))", [float(seconds)]


def claim_statement(table: str, column: Callable[[str], str], names: Sequence[str]) -> str:
    """The claim as one statement: insert, take over, reuse an expired record, or read it.

    ``names`` are the inserted columns in order; their parameters follow, then ``scope`` and
    ``key`` for the trailing read. The statement computes every time from ``NOW`` itself and
    returns the record's row, whether it was claimed, and the database time it judged by.

    ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` locks the conflicting row and re-checks the
    conditions on its latest version, so two claims can never both win. The conditions are
    ``statemachine.is_expired`` (absent) and ``Verdict.TAKE_OVER`` (stale) written in SQL; a
    property test holds them to the Python rules. When neither holds, the trailing SELECT
    returns the row as of the statement's snapshot, enough to replay or answer 409 or 422; if a
    concurrent statement committed the row after that snapshot, nothing comes back and the
    caller runs another round.
    """

    def col(name: str) -> str:
        return f"{table}.{column(name)}"

    def excluded(name: str) -> str:
        return f"EXCLUDED.{column(name)}"

    lease_running = (
        f"({col('status')} = 'PROCESSING' AND {col('lease_expires_at')} IS NOT NULL "
        f"AND {col('lease_expires_at')} > {NOW})"
    )
    expired = f"({col('expires_at')} <= {NOW} AND NOT {lease_running})"
    stale = (
        f"({col('status')} = 'PROCESSING' AND NOT {lease_running} "
        f"AND {col('fingerprint')} = {excluded('fingerprint')})"
    )
    assignments = [
        f"{column(name)} = {excluded(name)}"
        for name in names
        if name not in ("scope", "key", "attempts", "created_at")
    ]
    # A takeover continues the same logical request: its attempt count and first claim time
    # carry over. An expired record is a new request that happens to reuse the row.
    assignments.append(
        f"{column('attempts')} = CASE WHEN {expired} THEN 1 ELSE {col('attempts')} + 1 END"
    )
    assignments.append(
        f"{column('created_at')} = "
        f"CASE WHEN {expired} THEN {excluded('created_at')} ELSE {col('created_at')} END"
    )
    return (
        f"WITH claimed AS ("
        f"INSERT INTO {table} ({', '.join(column(name) for name in names)}) "
        f"VALUES ({', '.join(_value(name) for name in names)}) "
        f"ON CONFLICT ({column('scope')}, {column('key')}) "
        f"DO UPDATE SET {', '.join(assignments)} "
        f"WHERE {expired} OR {stale} "
        f"RETURNING {table}.*, true AS claimed) "
        f"SELECT *, {NOW} AS database_now FROM claimed UNION ALL "
        f"SELECT {table}.*, false AS claimed, {NOW} AS database_now FROM {table} "
        f"WHERE {col('scope')} = %s AND {col('key')} = %s "
        f"AND NOT EXISTS (SELECT 1 FROM claimed)"
    )


def _value(name: str) -> str:
    """The placeholder of an inserted column; times are the database's own."""
    if name == "created_at":
        return NOW
    if name in ("lease_expires_at", "expires_at"):
        return f"({NOW} + make_interval(secs => %s))"
    return "%s"


# --- outbox ------------------------------------------------------------------------------------
