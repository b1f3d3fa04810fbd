"""Topic -> publisher, from ``OUTBOX_PUBLISHERS``.

An exact topic wins; otherwise the first glob pattern (``fnmatch``: ``orders.*``, ``*``) in the
setting's order. Instances are built per relay and reused across its batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from django_idempotency.conf import conf, import_setting
from django_idempotency.exceptions import IdempotencyConfigurationError, UnroutableTopic
from django_idempotency.publishers.base import Publisher


@dataclass(frozen=True, slots=True)
class Route:
    pattern: str
    backend: str
    options: Mapping[str, Any]


def parse_spec(pattern: str, spec: Any) -> Route:
    """A route from a dotted path or ``{"BACKEND": path, "OPTIONS": {...}}``."""
    if isinstance(spec, str):
        return Route(pattern, spec, {})
    if isinstance(spec, Mapping) and isinstance(spec.get("BACKEND"), str):
        options = spec.get("OPTIONS", {})
        if isinstance(options, Mapping) and set(spec) <= {"BACKEND", "OPTIONS"}:
            return Route(pattern, spec["BACKEND"], options)
    raise IdempotencyConfigurationError(
        f"IDEMPOTENCY['OUTBOX_PUBLISHERS'][{pattern!r}] must be a dotted path or "
        f"{{'BACKEND': 'dotted.path', 'OPTIONS': {{...}}}}, not {spec!r}."
    )


def resolve_route(topic: str, routes: Mapping[str, Any] | None = None) -> Route:
    """The route for ``topic``; :class:`UnroutableTopic` names the setting to extend."""
    routes = conf.OUTBOX_PUBLISHERS if routes is None else routes
    if topic in routes:
        return parse_spec(topic, routes[topic])
    for pattern, spec in routes.items():
        if fnmatchcase(topic, pattern):
            return parse_spec(pattern, spec)
    raise UnroutableTopic(
        f"No publisher for topic {topic!r}: add a matching pattern to "
        f"IDEMPOTENCY['OUTBOX_PUBLISHERS'], for example {{{topic!r}: "
        f"'django_idempotency.publishers.celery.CeleryPublisher'}} or {{'*': ...}}."
    )


def build(route: Route) -> Publisher:
    setting = f"OUTBOX_PUBLISHERS[{route.pattern!r}]"
    backend = import_setting(setting, route.backend)
    if not (isinstance(backend, type) and issubclass(backend, Publisher)):
        raise IdempotencyConfigurationError(
            f"IDEMPOTENCY[{setting!r}] = {route.backend!r} is not a Publisher subclass."
        )
    try:
        return backend(**route.options)
    except TypeError as exc:
        raise IdempotencyConfigurationError(
            f"IDEMPOTENCY[{setting!r}] has options {backend.__name__} does not accept: {exc}"
        ) from exc


class PublisherSet:
    """The publishers one relay uses, built on first use and closed together."""

    def __init__(self) -> None:
        self._publishers: dict[Route, Publisher] = {}

    def for_topic(self, topic: str) -> Publisher:
        route = resolve_route(topic)
        key = Route(route.pattern, route.backend, _freeze(route.options))
        if key not in self._publishers:
            self._publishers[key] = build(route)
        return self._publishers[key]

    def close(self) -> None:
        publishers, self._publishers = list(self._publishers.values()), {}
        for publisher in publishers:
            publisher.close()


def _freeze(options: Mapping[str, Any]) -> Any:
    """A hashable stand-in for an options dict, so a route can key the cache."""
    return tuple(sorted((name, repr(value)) for name, value in options.items()))
