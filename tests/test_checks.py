"""Every system check id, and that the checks are registered."""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_idempotency import checks


def ids(**idempotency) -> set[str]:
    with override_settings(IDEMPOTENCY=idempotency):
        return {message.id for message in checks.check_settings()}


def test_defaults_are_clean():
    assert ids() == set()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"LEASE_SECONDS": 0}, checks.E002),
        ({"LEASE_SECONDS": "30"}, checks.E002),
        ({"LEASE_SECONDS": True}, checks.E002),
        ({"TTL_SECONDS": -1}, checks.E003),
        ({"TTL_SECONDS": 10, "LEASE_SECONDS": 30}, checks.E004),
        ({"SCOPE_RESOLVER": "no.such.module.resolver"}, checks.E005),
        ({"SCOPE_RESOLVER": "django_idempotency.conf.DEFAULTS"}, checks.E005),
        ({"STORED_STATUS_CODES": [200, 700]}, checks.E006),
        ({"STORED_STATUS_CODES": []}, checks.E006),
        ({"STORED_STATUS_CODES": "2xx"}, checks.E006),
        ({"STORED_RESPONSE_HEADERS": "Content-Type"}, checks.E007),
        ({"STORED_RESPONSE_HEADERS": ["Bad Header"]}, checks.E007),
        ({"MAX_RESPONSE_BYTES": -5}, checks.E008),
        ({"MAX_RESPONSE_BYTES": 1.5}, checks.E008),
        ({"HEADER": "Idempotency Key"}, checks.E009),
        ({"REPLAY_HEADER": ""}, checks.E009),
        ({"MIDDLEWARE_PATHS": ["(unclosed"]}, checks.E010),
        ({"MIDDLEWARE_PATHS": "^/api/"}, checks.E010),
        ({"KEY_REQUIRED": "yes"}, checks.E011),
        ({"MIDDLEWARE_METHODS": "POST"}, checks.E012),
        ({"LEASE_SECONS": 30}, checks.W001),
        ({"STORED_RESPONSE_HEADERS": ["Content-Type", "Set-Cookie"]}, checks.W002),
    ],
)
def test_each_mistake_has_its_id(settings, expected):
    assert expected in ids(**settings)


@override_settings(IDEMPOTENCY=["not", "a", "dict"])
def test_settings_must_be_a_dict():
    assert [message.id for message in checks.check_settings()] == [checks.E001]


@override_settings(DEBUG=False)
def test_sqlite_without_immediate_transactions_warns(settings):
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.sqlite3", "OPTIONS": {}}
    from django.db import connections

    original = connections.settings.get("default")
    connections.settings["default"] = {**original, **database}
    try:
        messages = checks.check_sqlite(databases=["default"])
    finally:
        connections.settings["default"] = original
    assert [message.id for message in messages] == [checks.W003]


@override_settings(DEBUG=False)
def test_sqlite_with_immediate_transactions_is_fine():
    from django.db import connections

    original = connections.settings["default"]
    connections.settings["default"] = {
        **original,
        "ENGINE": "django.db.backends.sqlite3",
        "OPTIONS": {"transaction_mode": "IMMEDIATE"},
    }
    try:
        assert checks.check_sqlite(databases=["default"]) == []
    finally:
        connections.settings["default"] = original


def test_middleware_before_authentication_warns(settings):
    settings.MIDDLEWARE = [
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django_idempotency.middleware.IdempotencyMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
    ]
    assert [m.id for m in checks.check_middleware_order()] == [checks.W004]


@pytest.mark.django_db  # Django 6's model checks ask the database about JSON support
def test_checks_are_registered_with_django():
    with override_settings(IDEMPOTENCY={"TTL_SECONDS": 1, "LEASE_SECONDS": 30}):
        assert checks.E004 in {message.id for message in run_checks()}
        with pytest.raises(SystemCheckError, match="django_idempotency.E004"):
            call_command("check")
