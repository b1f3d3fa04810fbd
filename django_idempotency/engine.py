"""Deprecated alias of the request engine, which became the lifecycle
(``django_idempotency.request.lifecycle``), the record store (``django_idempotency.request.store``)
and the shared types (``django_idempotency.core.types``, where ``Lease`` lives). Goes in 2.0."""

from django_idempotency.core import types
from django_idempotency.core.deprecation import moved
from django_idempotency.request import heartbeat, lifecycle, store

__all__: list[str] = []  # a deprecated alias: nothing of its own

__getattr__ = moved(__name__, types, lifecycle, store, heartbeat)
