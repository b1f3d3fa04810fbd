"""Layer 3, the transactional outbox: events written in the business transaction, relayed after.

``publish()`` (:mod:`.publish`) writes an event in the caller's transaction; the relay
(:mod:`.relay`) sends it to a broker through the publishers (:mod:`django_idempotency.publishers`);
:mod:`.operator` holds what a person does with failed events.
"""

from django_idempotency.outbox.operator import discard, retry_dead
from django_idempotency.outbox.publish import publish

__all__ = ["discard", "publish", "retry_dead"]
