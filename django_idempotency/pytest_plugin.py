"""pytest fixtures for projects using django-idempotency (registered through ``pytest11``).

``outbox_relay``: every topic goes to the in-memory broker and every commit relays at once, in
the test's thread. ``assert_publishes``, ``deliver_twice`` and ``deliver_concurrently`` are the
helpers of :mod:`django_idempotency.testing`. Nothing here imports Django until a fixture runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["assert_publishes", "deliver_concurrently", "deliver_twice", "outbox_relay"]


@pytest.fixture
def outbox_relay() -> Iterator[Any]:
    """An :class:`~django_idempotency.testing.OutboxRecorder` over a synchronous relay."""
    from django.conf import settings
    from django.test import override_settings

    from django_idempotency.testing import MEMORY_ROUTES, OutboxRecorder

    recorder = OutboxRecorder()
    recorder.clear()
    current = dict(getattr(settings, "IDEMPOTENCY", {}))
    overrides = {
        **current,
        "OUTBOX_PUBLISHERS": MEMORY_ROUTES,
        "OUTBOX_KICK": "django_idempotency.testing.relay_now",
    }
    with override_settings(IDEMPOTENCY=overrides):
        yield recorder
    recorder.clear()


@pytest.fixture
def assert_publishes() -> Any:
    from django_idempotency.testing import assert_publishes

    return assert_publishes


@pytest.fixture
def deliver_twice() -> Any:
    from django_idempotency.testing import deliver_twice

    return deliver_twice


@pytest.fixture
def deliver_concurrently() -> Any:
    from django_idempotency.testing import deliver_concurrently

    return deliver_concurrently
