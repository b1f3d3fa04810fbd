"""The statuses of an idempotency record (``core/statemachine.py`` says what each allows)."""

from __future__ import annotations

__all__ = ["ACCEPTED", "COMPLETED", "HELD", "PROCESSING"]

#: A request holds the key (its lease may have run out).
PROCESSING = "PROCESSING"
#: The response is stored; retries replay it until the record expires.
COMPLETED = "COMPLETED"
#: The request handed its work to a worker and answered 202 (stored, replayed to retries); the
#: worker holds the key, fenced by the same owner token, until it stores the final response.
ACCEPTED = "ACCEPTED"
#: The statuses in which somebody holds the key under a lease: the request, or its worker.
HELD = (PROCESSING, ACCEPTED)
