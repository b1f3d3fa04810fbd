"""Deprecated alias, kept so that old imports keep working; see the import paths below.

The request engine became the lifecycle (``django_idempotency.request.lifecycle``), the record
store (``django_idempotency.request.store``) and the shared types
(``django_idempotency.core.types``, where :class:`Lease` lives). This module goes in 2.0.
"""

import warnings
from typing import Any

from django_idempotency.core import types
from django_idempotency.request import heartbeat, lifecycle, store

_MODULES = (types, lifecycle, store, heartbeat)


def __getattr__(name: str) -> Any:
    for module in _MODULES:
        if hasattr(module, name):
            warnings.warn(
                f"django_idempotency.engine is deprecated; import {name} from {module.__name__}.",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(module, name)
    raise AttributeError(f"module 'django_idempotency.engine' has no attribute {name!r}")
