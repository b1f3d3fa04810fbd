from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_idempotency import conf as conf_module
from django_idempotency.conf import DEFAULTS, conf
from django_idempotency.exceptions import IdempotencyConfigurationError


def test_defaults_are_documented_values():
    with override_settings(IDEMPOTENCY={}):
        assert conf.LEASE_SECONDS == 30
        assert conf.TTL_SECONDS == 86400
        assert conf.KEY_REQUIRED is True
        assert conf.REPLAY_HEADER == "Idempotent-Replay"
        assert conf.MAX_RESPONSE_BYTES == 1024 * 1024
        assert 201 in conf.STORED_STATUS_CODES and 500 not in conf.STORED_STATUS_CODES
        assert frozenset({"content-type", "location"}) == conf.STORED_RESPONSE_HEADERS


def test_settings_are_read_live():
    with override_settings(IDEMPOTENCY={"LEASE_SECONDS": 5}):
        assert conf.LEASE_SECONDS == 5
        with override_settings(IDEMPOTENCY={"LEASE_SECONDS": 7}):
            assert conf.LEASE_SECONDS == 7
        assert conf.LEASE_SECONDS == 5


def test_a_setting_is_parsed_once_until_it_changes(monkeypatch):
    parses: list[str] = []
    real = conf_module.import_setting

    def counting(name, value):
        parses.append(name)
        return real(name, value)

    monkeypatch.setattr(conf_module, "import_setting", counting)
    resolver = "django_idempotency.request.scopes.user_scope"
    with override_settings(IDEMPOTENCY={"SCOPE_RESOLVER": resolver}):
        first = conf.SCOPE_RESOLVER
        assert conf.SCOPE_RESOLVER is first
        assert parses == ["SCOPE_RESOLVER"]
        with override_settings(IDEMPOTENCY={"SCOPE_RESOLVER": "django_idempotency.request"}):
            assert conf.SCOPE_RESOLVER is not first  # a new value is parsed anew
        assert conf.SCOPE_RESOLVER is first  # and the old one again once restored
    assert parses == ["SCOPE_RESOLVER"] * 3


def test_a_setting_that_cannot_be_parsed_fails_on_every_read():
    with override_settings(IDEMPOTENCY={"LEASE_SECONDS": "soon"}):
        for _ in range(2):
            with pytest.raises(IdempotencyConfigurationError):
                conf.LEASE_SECONDS  # noqa: B018


def test_sensitive_headers_are_never_in_the_allow_list():
    with override_settings(IDEMPOTENCY={"STORED_RESPONSE_HEADERS": ["Set-Cookie", "ETag"]}):
        assert frozenset({"etag"}) == conf.STORED_RESPONSE_HEADERS


def test_bad_dotted_path_names_the_setting():
    with (
        override_settings(IDEMPOTENCY={"SCOPE_RESOLVER": "nowhere.resolver"}),
        pytest.raises(IdempotencyConfigurationError, match=r"IDEMPOTENCY\['SCOPE_RESOLVER'\]"),
    ):
        conf.SCOPE_RESOLVER  # noqa: B018


def test_every_default_has_a_property():
    missing = [name for name in DEFAULTS if not hasattr(type(conf), name)]
    assert missing == []


# --- values read from the environment ------------------------------------------------------------

BOOLEANS = sorted(name for name, value in DEFAULTS.items() if isinstance(value, bool))
NUMBERS = sorted(
    name
    for name, value in DEFAULTS.items()
    if isinstance(value, int | float) and not isinstance(value, bool)
)
TRUE = [True, 1, "1", "true", "True", "YES", "on", " On "]
FALSE = [False, 0, "0", "false", "FALSE", "no", "off", " off\n"]
NOT_BOOLEANS = ["", "maybe", "t", "enabled", 2, -1, 0.0, 1.0, None, [], ["true"]]


def test_the_boolean_settings_are_the_ones_the_issue_names():
    assert {
        "KEY_REQUIRED",
        "LEASE_HEARTBEAT",
        "LOG_KEYS",
        "REGISTER_ADMIN",
        "METRICS",
        "TRACING",
        "OUTBOX_REQUIRE_ATOMIC",
        "OUTBOX_NOTIFY",
    } <= set(BOOLEANS)


@pytest.mark.parametrize("name", BOOLEANS)
def test_booleans_accept_the_usual_spellings(name):
    for value in TRUE:
        with override_settings(IDEMPOTENCY={name: value}):
            assert getattr(conf, name) is True, value
    for value in FALSE:
        with override_settings(IDEMPOTENCY={name: value}):
            assert getattr(conf, name) is False, value


@pytest.mark.django_db(databases="__all__")  # `check` runs Django's model checks too
@pytest.mark.parametrize("name", BOOLEANS)
@pytest.mark.parametrize("value", NOT_BOOLEANS)
def test_anything_else_is_an_error_never_a_silent_true(name, value):
    """The same message at runtime and from ``manage.py check``: the setting and the type."""
    with override_settings(IDEMPOTENCY={name: value}):
        with pytest.raises(IdempotencyConfigurationError) as raised:
            getattr(conf, name)
        message = str(raised.value)
        assert f"IDEMPOTENCY[{name!r}] got a {type(value).__name__} " in message
        with pytest.raises(SystemCheckError) as checked:
            call_command("check")
    assert message in str(checked.value)


def test_a_boolean_message_names_the_type_not_the_value():
    with (
        override_settings(IDEMPOTENCY={"LOG_KEYS": "hunter2"}),
        pytest.raises(IdempotencyConfigurationError) as raised,
    ):
        conf.LOG_KEYS  # noqa: B018
    assert "hunter2" not in str(raised.value) and "got a str" in str(raised.value)


@pytest.mark.django_db(databases="__all__")
@pytest.mark.parametrize("name", NUMBERS)
def test_numbers_given_as_strings_keep_working(name):
    default = DEFAULTS[name]
    with override_settings(IDEMPOTENCY={name: f" {default} "}):
        assert getattr(conf, name) == default
        out = StringIO()
        call_command("check", stdout=out, stderr=out)  # no error
        assert f"IDEMPOTENCY[{name!r}]" not in out.getvalue()


@pytest.mark.django_db(databases="__all__")
@pytest.mark.parametrize("name", NUMBERS)
@pytest.mark.parametrize("value", ["soon", "", None, True, [30]])
def test_a_non_number_is_an_error_naming_the_setting(name, value):
    with override_settings(IDEMPOTENCY={name: value}):
        with pytest.raises(
            IdempotencyConfigurationError, match=re.escape(f"IDEMPOTENCY[{name!r}]")
        ):
            getattr(conf, name)
        with pytest.raises(SystemCheckError, match=re.escape(f"IDEMPOTENCY[{name!r}]")):
            call_command("check")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("LEASE_SECONDS", "2.5", 2.5),
        ("MAX_RESPONSE_BYTES", "2048", 2048),
        ("OUTBOX_BATCH_SIZE", 7, 7),
        ("SWEEP_BATCH_SIZE", "1_000", 1000),
    ],
)
def test_numbers_have_their_setting_type(name, value, expected):
    with override_settings(IDEMPOTENCY={name: value}):
        assert getattr(conf, name) == expected


def test_a_whole_number_setting_refuses_a_fraction():
    with (
        override_settings(IDEMPOTENCY={"OUTBOX_BATCH_SIZE": "2.5"}),
        pytest.raises(IdempotencyConfigurationError, match="not a whole number"),
    ):
        conf.OUTBOX_BATCH_SIZE  # noqa: B018


# --- credentials the middleware cannot see -------------------------------------------------------


def test_credential_settings_defaults():
    with override_settings(IDEMPOTENCY={}):
        assert conf.CREDENTIAL_HEADERS == ("Authorization",)
        assert conf.CREDENTIAL_SCOPE == "digest"


@pytest.mark.parametrize(("value", "expected"), [("refuse", "refuse"), (" Digest ", "digest")])
def test_credential_scope_values(value, expected):
    with override_settings(IDEMPOTENCY={"CREDENTIAL_SCOPE": value}):
        assert expected == conf.CREDENTIAL_SCOPE


@pytest.mark.parametrize("value", ["ignore", None, True])
def test_credential_scope_refuses_other_values(value):
    with (
        override_settings(IDEMPOTENCY={"CREDENTIAL_SCOPE": value}),
        pytest.raises(IdempotencyConfigurationError, match="CREDENTIAL_SCOPE"),
    ):
        conf.CREDENTIAL_SCOPE  # noqa: B018


def test_credential_headers_must_be_a_list():
    with override_settings(IDEMPOTENCY={"CREDENTIAL_HEADERS": ["Authorization", "X-Api-Key"]}):
        assert conf.CREDENTIAL_HEADERS == ("Authorization", "X-Api-Key")
    with (
        override_settings(IDEMPOTENCY={"CREDENTIAL_HEADERS": "Authorization"}),
        pytest.raises(IdempotencyConfigurationError, match="CREDENTIAL_HEADERS"),
    ):
        conf.CREDENTIAL_HEADERS  # noqa: B018
