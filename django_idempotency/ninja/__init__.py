"""The door for Django Ninja (the ``ninja`` extra): ``@idempotent`` on Ninja operations, sync
and async, scoped by Ninja's auth, with the key and the answers in Ninja's OpenAPI schema.

Nothing else in the package imports this package: Ninja stays optional.
"""

from django_idempotency.ninja.door import idempotent
from django_idempotency.ninja.openapi import idempotency_openapi
from django_idempotency.ninja.scopes import ninja_scope

__all__ = ["idempotency_openapi", "idempotent", "ninja_scope"]
