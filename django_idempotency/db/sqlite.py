"""SQL that only SQLite speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from typing import Any

# --- idempotency records -----------------------------------------------------------------------

#: The database's time in UTC, in the text form Django stores (milliseconds: SQLite's clock
#: has no finer grain). The percent signs are doubled for the driver's parameter syntax.
NOW = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"


def now_plus(seconds: float) -> tuple[str, list[Any]]:
    """The database's time plus ``seconds``, as SQL and its parameters."""
    return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)", [f"{seconds:+.6f} seconds"]


# --- outbox ------------------------------------------------------------------------------------
