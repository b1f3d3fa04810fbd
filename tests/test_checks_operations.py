"""System checks for the operations settings: E060, W060, W061."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_idempotency import checks


def ids(messages) -> list[str]:
    return [message.id for message in messages]


def test_defaults_are_clean():
    assert checks.check_operations() == []


@pytest.mark.parametrize("name", ["REGISTER_ADMIN", "METRICS", "TRACING"])
def test_e060_not_a_bool(name):
    with override_settings(IDEMPOTENCY={name: "yes"}):
        messages = checks.check_operations()
    assert ids(messages) == [checks.E060]
    assert name in messages[0].msg


@pytest.mark.parametrize(
    ("name", "module", "warning_id", "extra"),
    [
        ("METRICS", "prometheus_client", checks.W060, "metrics"),
        ("TRACING", "opentelemetry.trace", checks.W061, "otel"),
    ],
)
def test_w060_w061_switched_on_without_the_package(monkeypatch, name, module, warning_id, extra):
    monkeypatch.setattr(checks, "importable", lambda candidate: candidate != module)
    with override_settings(IDEMPOTENCY={name: True}):
        messages = checks.check_operations()
    assert ids(messages) == [warning_id]
    assert f"django-idempotency[{extra}]" in messages[0].hint
    with override_settings(IDEMPOTENCY={}):  # the default does not insist: no warning
        assert checks.check_operations() == []


def test_installed_packages_satisfy_an_explicit_true():
    with override_settings(IDEMPOTENCY={"METRICS": True, "TRACING": True}):
        assert checks.check_operations() == []


def test_importable():
    assert checks.importable("prometheus_client")
    assert not checks.importable("no_such_package.sub")


@pytest.mark.django_db  # Django 6 runs the database checks too
def test_check_is_registered():
    with (
        override_settings(IDEMPOTENCY={"METRICS": 1}),
        pytest.raises(SystemCheckError, match="E060"),
    ):
        call_command("check")
