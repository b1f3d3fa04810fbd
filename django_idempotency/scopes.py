"""Deprecated alias of ``django_idempotency.request.scopes``; import from there. Goes in 2.0."""

from django_idempotency.core.deprecation import moved
from django_idempotency.request import scopes

__getattr__ = moved(__name__, scopes)
