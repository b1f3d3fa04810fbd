"""System checks for the operations settings: E060, W060, W061."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_idempotency import checks


def check_operations() -> list:
    return [message for check in checks.OPERATIONS_CHECKS for message in check()]


def ids(messages) -> list[str]:
    return [message.id for message in messages]


def test_defaults_are_clean():
    assert check_operations() == []


@pytest.mark.parametrize("name", ["REGISTER_ADMIN", "METRICS", "TRACING"])
@pytest.mark.parametrize("value", ["sometimes", 2, None, [True]])
def test_e060_not_a_boolean(name, value):
    with override_settings(IDEMPOTENCY={name: value}):
        messages = check_operations()
    assert ids(messages) == [checks.E060]
    assert f"IDEMPOTENCY[{name!r}]" in messages[0].msg
    assert type(value).__name__ in messages[0].msg


@pytest.mark.parametrize("name", ["REGISTER_ADMIN", "METRICS", "TRACING"])
@pytest.mark.parametrize("value", [True, False, 0, 1, "yes", "Off", " 1 "])
def test_e060_quiet_for_booleans_from_the_environment(name, value):
    with override_settings(IDEMPOTENCY={name: value}):
        assert check_operations() == []


@pytest.mark.parametrize(
    ("name", "module", "warning_id", "extra"),
    [
        ("METRICS", "prometheus_client", checks.W060, "metrics"),
        ("TRACING", "opentelemetry.trace", checks.W061, "otel"),
    ],
)
def test_w060_w061_switched_on_without_the_package(monkeypatch, name, module, warning_id, extra):
    monkeypatch.setattr(checks.base, "importable", lambda candidate: candidate != module)
    for on in (True, "true", 1):
        with override_settings(IDEMPOTENCY={name: on}):
            messages = check_operations()
        assert ids(messages) == [warning_id]
        assert f"django-idempotency[{extra}]" in messages[0].hint
    with override_settings(IDEMPOTENCY={name: "off"}):  # switched off: nothing to warn about
        assert check_operations() == []
    with override_settings(IDEMPOTENCY={}):  # the default does not insist: no warning
        assert check_operations() == []


def test_installed_packages_satisfy_an_explicit_true():
    with override_settings(IDEMPOTENCY={"METRICS": True, "TRACING": True}):
        assert check_operations() == []


def test_importable():
    assert checks.importable("prometheus_client")
    assert not checks.importable("no_such_package.sub")


@pytest.mark.django_db(databases="__all__")  # Django 6 runs the database checks too
def test_check_is_registered():
    with (
        override_settings(IDEMPOTENCY={"METRICS": "sometimes"}),
        pytest.raises(SystemCheckError, match="E060"),
    ):
        call_command("check")
