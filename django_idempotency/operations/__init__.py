"""The operations side: what an operator does and sees (actions, health, metrics, sweeps).

The admin's actions call the functions re-exported here; so can commands and scripts.
"""

from django_idempotency.operations.actions import ReleaseResult, release_records
from django_idempotency.outbox.operator import EventResult, discard_events, retry_events

__all__ = ["EventResult", "ReleaseResult", "discard_events", "release_records", "retry_events"]
