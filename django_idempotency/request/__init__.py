"""Layer 1, idempotency keys: the doors and the lifecycle they all go through.

The doors translate a call into the lifecycle's terms and its outcome back: the middleware
(``middleware.py``), ``@idempotent`` for views (``decorators.py``), ``@idempotent_function``
(``idempotent_function.py``), hand-offs to a worker (``handoff.py``), status by key
(``status.py``); DRF's door is the ``drf`` package. The lifecycle (``lifecycle.py``) claims,
runs, completes or releases through the claim (``claims.py``) and the record store
(``store.py``) in the database, the Redis copy (``redis_copy.py``) and the answers kept in
memory (``memory.py``); the rules themselves are in :mod:`django_idempotency.core`.
"""

__all__: list[str] = []
