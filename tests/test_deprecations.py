"""Import paths that moved keep working, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib

import pytest

from django_idempotency.core import types
from django_idempotency.operations import health, metrics
from django_idempotency.request import lifecycle, scopes

MOVED = [
    ("django_idempotency.engine", "Lease", types.Lease, "django_idempotency.core.types"),
    ("django_idempotency.engine", "serve", lifecycle.serve, "django_idempotency.request.lifecycle"),
    (
        "django_idempotency.scopes",
        "user_scope",
        scopes.user_scope,
        "django_idempotency.request.scopes",
    ),
    (
        "django_idempotency.health",
        "outbox_health",
        health.outbox_health,
        "django_idempotency.operations.health",
    ),
    (
        "django_idempotency.metrics",
        "OutboxCollector",
        metrics.OutboxCollector,
        "django_idempotency.operations.metrics",
    ),
]


@pytest.mark.parametrize(("old", "name", "new", "new_path"), MOVED)
def test_an_old_import_path_still_works_and_says_where_to_go(old, name, new, new_path):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"import {name} from {new_path}"):
        assert getattr(module, name) is new


def test_a_name_that_never_existed_is_an_attribute_error():
    module = importlib.import_module("django_idempotency.engine")
    with pytest.raises(AttributeError):
        module.no_such_thing  # noqa: B018
