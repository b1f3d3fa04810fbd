"""Django REST framework's door: :class:`IdempotencyMixin` for APIView, generic views and
ViewSets (``mixin.py``), status by key as DRF views (``views.py``), the browsable API that sends
keys (``browsable.py``) and the OpenAPI extensions for drf-spectacular (``openapi.py``).

Importing this package imports DRF: the rest of the app never does.
"""

from django_idempotency.drf.mixin import IdempotencyMixin

__all__ = ["IdempotencyMixin"]
