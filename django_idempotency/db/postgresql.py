"""SQL that only PostgreSQL speaks, for the record store and the outbox.

Everything else is portable ORM code; a statement lives here only when the portable form would
be slower or wrong on this backend, and each one has a portable fallback or a test that shows
why it is not needed.
"""

from __future__ import annotations

from datetime import datetime

from django.db.backends.base.base import BaseDatabaseWrapper

# --- idempotency records -----------------------------------------------------------------------

# --- outbox ------------------------------------------------------------------------------------

#: The class id (first ``int4``) of the advisory locks ``publish()`` takes per ordering key. The
#: two-``int4`` form lives apart from the one-``bigint`` form applications usually use, and this
#: class keeps our locks apart from other users of the two-``int4`` form (it is
#: ``crc32("django_idempotency.outbox") & 0x7fffffff``).
OUTBOX_KEY_LOCK_CLASS = 1_638_184_608


def before_outbox_insert(
    connection: BaseDatabaseWrapper, *, lock_key: str | None, notify_channel: str | None
) -> None:
    """What ``publish()`` does before its INSERT, in one round trip (none if there is nothing).

    ``lock_key``: take the key's transaction-scoped advisory lock, so a second transaction that
    publishes the same key waits here until this one commits or rolls back, and draws its event
    id from the sequence only then: same-key ids are in commit order. ``hashtext`` collisions
    only make two keys take turns needlessly. Rolling back to a savepoint taken before the lock
    releases it.

    ``notify_channel``: ``NOTIFY`` it, which PostgreSQL delivers at commit and drops on rollback,
    so listening relays wake only for committed events.
    """
    calls: list[str] = []
    params: list[int | str] = []
    if lock_key:
        calls.append("pg_advisory_xact_lock(%s, hashtext(%s::text))")
        params += [OUTBOX_KEY_LOCK_CLASS, lock_key]
    if notify_channel:
        calls.append("pg_notify(%s, '')")
        params.append(notify_channel)
    if calls:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {', '.join(calls)}", params)


def begin_outbox_claim(connection: BaseDatabaseWrapper) -> datetime:
    """Pin the relay claim's plan for its transaction and return the database's time.

    The outbox is a queue, so its statistics are usually stale, and a planner that misjudges
    them fetches every pending row, runs the per-key subquery on each and sorts them all;
    without sorting it walks the relay index in order and stops after one batch. JIT would take
    far longer to compile the plan than the plan takes to run. ``set_config(..., true)`` lasts
    until the transaction ends.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('enable_sort', 'off', true), set_config('jit', 'off', true), "
            "statement_timestamp()"
        )
        row = cursor.fetchone()
    now: datetime = row[2]
    return now
