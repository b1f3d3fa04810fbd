"""Signals sent by all three layers; connect to them for metrics, traces or audit.

The request state machine's signals are sent with ``sender`` =
:class:`~django_idempotency.models.IdempotencyRecord` and the keyword arguments listed beside
them; ``key`` is the raw key: redact it before logging. The outbox, consumer and sweep signals
further down name their senders.
"""

from django.dispatch import Signal

__all__ = [
    "claim_finished",
    "duplicate_skipped",
    "event_dead",
    "event_enqueued",
    "event_published",
    "events_discarded",
    "events_retried",
    "failures_forgotten",
    "key_claimed",
    "key_released",
    "key_taken_over",
    "lease_lost",
    "payload_mismatched",
    "publish_failed",
    "redis_copy_failed",
    "request_completed",
    "request_conflicted",
    "request_handed_off",
    "response_replayed",
    "rows_swept",
]

#: A request claimed a key and is about to run. kwargs: ``scope``, ``key``, ``attempt``.
key_claimed = Signal()

#: A request whose key had expired its lease took it over. kwargs: ``scope``, ``key``, ``attempt``.
key_taken_over = Signal()

#: A retry was answered with the stored response. kwargs: ``scope``, ``key``, ``status``.
response_replayed = Signal()

#: A retry arrived while the key was held: 409. kwargs: ``scope``, ``key``, ``retry_after``.
request_conflicted = Signal()

#: A key was reused for a different request: 422. kwargs: ``scope``, ``key``.
payload_mismatched = Signal()

#: A request's completion found another owner; its writes were rolled back.
#: kwargs: ``scope``, ``key``.
lease_lost = Signal()

#: A response was stored. kwargs: ``scope``, ``key``, ``status``, ``retained``.
request_completed = Signal()

#: A request answered 202 and handed its work to a worker (``hand_off``); ``request_completed``
#: follows when the worker stores the final response. kwargs: ``scope``, ``key``, ``status``.
request_handed_off = Signal()

#: A key was released so it can be used again: after a failure (``reason`` ``"exception"`` or
#: ``"not_stored"``) or by an operator in the admin (``"admin"``). kwargs: ``scope``, ``key``,
#: ``reason``.
key_released = Signal()

#: A call to the Redis copy failed and the request used the database instead (never a
#: duplicate). kwargs: ``scope``, ``key``, ``operation`` (``lookup``, ``remember`` or ``forget``),
#: ``error`` (the exception). A failed ``forget`` means a stale copy may live until its expiry.
redis_copy_failed = Signal()
#: A claim was decided (or failed). kwargs: ``scope``, ``key``, ``outcome`` (``"claimed"``,
#: ``"replayed"``, ``"conflicted"``, ``"mismatched"``, ``"unavailable"`` or ``"error"``),
#: ``duration`` (seconds, float).
claim_finished = Signal()

# --- Layer 3: the outbox. Sent with ``sender`` = OutboxEvent. ----------------------------------

#: ``publish()`` wrote an event in the caller's transaction (it may still roll back).
#: kwargs: ``event`` (the :class:`OutboxEvent`).
event_enqueued = Signal()

#: The broker accepted an event and the relay marked it PUBLISHED.
#: kwargs: ``event``, ``publisher`` (the publisher's class name).
event_published = Signal()

#: The same, once per batch and publisher: what a receiver that counts or ships events in bulk
#: should listen to (``event_published`` costs a dispatch per event). kwargs: ``events`` (a list
#: of :class:`OutboxEvent`, in the order they were sent), ``publisher``.
events_published = Signal()

#: Publishing an event failed; it is retried at ``next_attempt_at``, or is DEAD when that is None.
#: kwargs: ``event``, ``error`` (the exception), ``attempts`` (failures so far),
#: ``next_attempt_at``.
publish_failed = Signal()

#: An event failed ``OUTBOX_MAX_ATTEMPTS`` times and waits for a person (``retry_dead``).
#: kwargs: ``event``, ``error``.
event_dead = Signal()

#: An operator retried failed events (an admin action, ``operations.retry_events`` or
#: ``retry_failure_group``); sent once the last batch committed, also when none changed.
#: kwargs: ``count`` (events queued again), ``failure_group`` (the group's fingerprint, or None
#: for a selection of events).
events_retried = Signal()

#: An operator discarded failed events, as for ``events_retried``. kwargs: ``count`` (events
#: deleted), ``failure_group``.
events_discarded = Signal()

# --- Layer 2: idempotent consumers. Sent with ``sender`` = ProcessedMessage. -------------------

#: A consumer received a message it had already processed and skipped it.
#: kwargs: ``consumer``, ``message_id``.
duplicate_skipped = Signal()

#: An operator forgot the records of failed messages (the admin's action,
#: ``operations.actions.forget_failed_messages``); sent with ``sender`` = FailedMessage once
#: the last batch committed. kwargs: ``count``, ``failure_group`` (a fingerprint, or None).
failures_forgotten = Signal()

# --- Sweeps. Sent with ``sender`` = the model swept. --------------------------------------------

#: A sweep deleted rows in one batch. kwargs: ``count``, ``sweep`` (the sweep's name).
rows_swept = Signal()
