"""Deprecated alias of ``django_idempotency.request.scopes``; import from there. Goes in 2.0."""

from django_idempotency.core.deprecation import moved
from django_idempotency.request import scopes

__all__: list[str] = []  # a deprecated alias: nothing of its own

__getattr__ = moved(__name__, scopes)
