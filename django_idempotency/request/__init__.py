"""Layer 1, idempotency keys on requests: the lifecycle every entry point calls, and what it uses.

The entry points (``middleware.py``, ``decorators.py``, ``drf.py``) translate a request into the
lifecycle's terms; the lifecycle drives claim, run, complete or release through the record store
(the database) and the optional Redis cache; the rules themselves are in
:mod:`django_idempotency.core.statemachine`.
"""

__all__: list[str] = []
