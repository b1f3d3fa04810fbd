"""SQL that only SQLite speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

# --- idempotency records -----------------------------------------------------------------------

# --- outbox ------------------------------------------------------------------------------------
