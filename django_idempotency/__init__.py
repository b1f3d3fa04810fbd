"""Exactly-once effects for Django and Django REST framework."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_idempotency.request.idempotent_function import idempotent_function

__version__ = "0.1.0"

__all__ = ["__version__", "idempotent_function"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the package: the decorator's module reaches the models,
    # which must not load before Django's app registry.
    if name == "idempotent_function":
        from django_idempotency.request.idempotent_function import idempotent_function

        return idempotent_function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
