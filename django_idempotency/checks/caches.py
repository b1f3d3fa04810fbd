"""Checks of the caches in front of the database: the Redis copy of completed responses
(``CACHE_ALIAS``, E040-E042, W040) and the answers kept in a process's memory
(``LOCAL_REPLAY_SECONDS``, E043, E044). W041, the answers kept in memory in production, is a
deploy check (:mod:`django_idempotency.checks.deploy`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from django.conf import settings
from django.core.checks import Tags

from django_idempotency.checks.base import Check, Context, Finding, _bad_numbers
from django_idempotency.checks.ids import E040, E041, E042, E043, E044, W040

_DJANGO_REDIS_BACKEND = "django_redis.cache.RedisCache"


def _cache(c: Context) -> tuple[str, Mapping[str, Any]] | None:
    """(alias, its CACHES entry) when CACHE_ALIAS names a configured cache."""
    alias = c.merged["CACHE_ALIAS"]
    caches = getattr(settings, "CACHES", {})
    if isinstance(alias, str) and alias in caches:
        return alias, caches[alias]
    return None


def _unknown_cache(c: Context) -> Iterator[Finding]:
    alias = c.merged["CACHE_ALIAS"]
    if alias is not None and _cache(c) is None:
        yield {"alias": alias}


def _not_django_redis(c: Context) -> Iterator[Finding]:
    found = _cache(c)
    if found is not None and found[1].get("BACKEND") != _DJANGO_REDIS_BACKEND:
        yield {"alias": found[0], "backend": found[1].get("BACKEND")}


def _no_socket_timeouts(c: Context) -> Iterator[Finding]:
    found = _cache(c)
    if found is None or found[1].get("BACKEND") != _DJANGO_REDIS_BACKEND:
        return
    options = found[1].get("OPTIONS") or {}
    if not options.get("SOCKET_TIMEOUT") or not options.get("SOCKET_CONNECT_TIMEOUT"):
        yield {"alias": found[0]}


CACHE_CHECKS: tuple[Check, ...] = (
    Check(
        E043,
        _bad_numbers("LOCAL_REPLAY_SECONDS", zero=True),
        "IDEMPOTENCY['LOCAL_REPLAY_SECONDS'] must be a number of seconds >= 0, not {value}.",
        "0 (the default) keeps no answer in memory; a few seconds cover a retry storm.",
    ),
    Check(
        E044,
        _bad_numbers("LOCAL_REPLAY_ENTRIES", whole=True),
        "IDEMPOTENCY['LOCAL_REPLAY_ENTRIES'] must be a whole number > 0, not {value}.",
        "The most answers one process keeps in memory; the default is 1000.",
    ),
    Check(
        E042,
        _bad_numbers("CACHE_RETRY_SECONDS", zero=True),
        "IDEMPOTENCY['CACHE_RETRY_SECONDS'] must be a number of seconds >= 0, not {value}.",
        "0 retries Redis on every request; the default is 5.",
        tags=(Tags.caches,),
    ),
    Check(
        E040,
        _unknown_cache,
        "IDEMPOTENCY['CACHE_ALIAS'] = {alias!r} is not an alias in CACHES.",
        "Name a django-redis cache from CACHES, or set it to None for the database only.",
        tags=(Tags.caches,),
    ),
    Check(
        E041,
        _not_django_redis,
        "CACHES[{alias!r}] (IDEMPOTENCY['CACHE_ALIAS']) uses {backend!r}; the Redis copy needs "
        f"{_DJANGO_REDIS_BACKEND!r}.",
        "Install the 'redis' extra (pip install -e '/path/to/django-idempotency[redis]' from "
        "a checkout, see docs/installation.md) and set that BACKEND.",
        tags=(Tags.caches,),
    ),
    Check(
        W040,
        _no_socket_timeouts,
        "CACHES[{alias!r}] (IDEMPOTENCY['CACHE_ALIAS']) sets no SOCKET_TIMEOUT or "
        "SOCKET_CONNECT_TIMEOUT: a Redis that hangs would hang every idempotent request.",
        "Set OPTIONS = {{'SOCKET_CONNECT_TIMEOUT': 0.1, 'SOCKET_TIMEOUT': 0.1}}; on a timeout "
        "the request falls back to the database.",
        tags=(Tags.caches,),
    ),
)
