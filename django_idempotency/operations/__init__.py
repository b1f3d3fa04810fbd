"""The operations side: what an operator does and sees (actions, health, metrics, sweeps).

The admin's actions call the functions re-exported here; so can commands and scripts.
"""

from django_idempotency.operations.actions import (
    EventResult,
    FailureGroupSelection,
    ReleaseResult,
    discard_events,
    discard_failure_group,
    release_records,
    retry_events,
    retry_failure_group,
)

__all__ = [
    "EventResult",
    "FailureGroupSelection",
    "ReleaseResult",
    "discard_events",
    "discard_failure_group",
    "release_records",
    "retry_events",
    "retry_failure_group",
]
