"""System checks of the Redis copy's settings (E040, E041, E042, W040)."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_idempotency import checks

REDIS = {
    "BACKEND": "django_redis.cache.RedisCache",
    "LOCATION": "redis://127.0.0.1:6379/2",
    "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.1, "SOCKET_TIMEOUT": 0.1},
}


def check_redis_copy():
    return [message for check in checks.CACHE_CHECKS for message in check()]


def ids(settings, alias, caches):
    settings.CACHES = caches
    settings.IDEMPOTENCY = {"CACHE_ALIAS": alias}
    return [message.id for message in check_redis_copy()]


def test_no_alias_is_fine(settings):
    assert ids(settings, None, {"default": REDIS}) == []


def test_good_alias_is_fine(settings):
    assert ids(settings, "copies", {"default": REDIS, "copies": REDIS}) == []


@pytest.mark.parametrize("alias", ["missing", 3])
def test_unknown_alias(settings, alias):
    assert ids(settings, alias, {"default": REDIS}) == [checks.E040]


def test_not_django_redis(settings):
    locmem = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    assert ids(settings, "default", {"default": locmem}) == [checks.E041]


def test_no_socket_timeouts(settings):
    untimed = {**REDIS, "OPTIONS": {}}
    assert ids(settings, "default", {"default": untimed}) == [checks.W040]


@pytest.mark.parametrize("retry", [-1, "-1", "soon", None, True])
def test_retry_seconds_must_be_a_number_at_least_zero(settings, retry):
    settings.IDEMPOTENCY = {"CACHE_RETRY_SECONDS": retry}
    assert [message.id for message in check_redis_copy()] == [checks.E042]


@pytest.mark.parametrize("retry", [0, 0.5, 30, "5", " 0.25 "])
def test_retry_seconds_accepts_zero_and_more(settings, retry):
    settings.IDEMPOTENCY = {"CACHE_RETRY_SECONDS": retry}
    assert check_redis_copy() == []


@pytest.mark.django_db(databases="__all__")  # Django 6 asks every database about JSON
def test_checks_are_bound(settings):
    settings.IDEMPOTENCY = {"CACHE_ALIAS": "missing"}
    with pytest.raises(SystemCheckError, match="E040"):
        call_command("check")
