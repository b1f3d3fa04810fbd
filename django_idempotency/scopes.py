"""Deprecated alias, kept so that old imports keep working; see the import path below.

Import from ``django_idempotency.request.scopes`` instead; this module goes in 2.0.
"""

import warnings
from typing import Any

from django_idempotency.request import scopes as _target


def __getattr__(name: str) -> Any:
    warnings.warn(
        f"django_idempotency.scopes is deprecated; "
        f"import {name} from django_idempotency.request.scopes.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_target, name)
