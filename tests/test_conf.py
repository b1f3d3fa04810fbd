from __future__ import annotations

import pytest
from django.test import override_settings

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
