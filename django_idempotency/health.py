"""Deprecated alias of ``django_idempotency.operations.health``; import from there. Goes in 2.0."""

from django_idempotency.core.deprecation import moved
from django_idempotency.operations import health

__all__: list[str] = []  # a deprecated alias: nothing of its own

__getattr__ = moved(__name__, health)
