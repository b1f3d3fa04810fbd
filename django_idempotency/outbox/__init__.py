"""Layer 3, the transactional outbox: events written in the business transaction, relayed after.

``publish()`` (:mod:`.publish`) writes an event in the caller's transaction; the relay
(:mod:`.relay`) sends it to a broker through the publishers (:mod:`django_idempotency.publishers`).
Each step of a relay's pass has its module, below the relay: :mod:`.claim`, :mod:`.send`,
:mod:`.ack` and :mod:`.announce`; beside them :mod:`.clock`, :mod:`.lease`, :mod:`.fleet`,
:mod:`.waiting` and :mod:`.report`. What a person does with failed events is
:mod:`django_idempotency.operations.actions`.
"""

from django_idempotency.outbox.publish import publish

__all__ = ["publish"]
