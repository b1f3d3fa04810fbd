"""Topic -> publisher, from ``OUTBOX_PUBLISHERS``.

An exact topic wins; otherwise the first glob pattern (``fnmatch``: ``orders.*``, ``*``) in the
setting's order. Instances are built per relay and reused across its batches.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from django.utils.module_loading import import_string

from django_idempotency.conf import conf
from django_idempotency.exceptions import IdempotencyConfigurationError, UnroutableTopic
from django_idempotency.publishers.base import Publisher

__all__ = [
    "PublisherSet",
    "Route",
    "SETTING",
    "build",
    "options_problem",
    "parse_spec",
    "resolve_route",
    "route_setting",
    "spec_problem",
]

#: The setting every message below names.
SETTING = "IDEMPOTENCY['OUTBOX_PUBLISHERS']"
_SPEC_KEYS = frozenset({"BACKEND", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class Route:
    pattern: str
    backend: str
    #: Kept out of the repr: options hold signing secrets and broker passwords.
    options: Mapping[str, Any] = field(repr=False)


def route_setting(pattern: str) -> str:
    """``IDEMPOTENCY['OUTBOX_PUBLISHERS']['orders.*']``: where a route's problem lies."""
    return f"{SETTING}[{pattern!r}]"


def _names(keys: Any) -> str:
    """Key names for a message, each cut short: names, never the values beside them."""
    return ", ".join(repr(key[:40]) if isinstance(key, str) else type(key).__name__ for key in keys)


def spec_problem(spec: Any) -> str | None:
    """What is wrong with one route's spec, in words that never quote an option value."""
    if isinstance(spec, str):
        return None
    if not isinstance(spec, Mapping):
        return (
            f"must be a dotted path or {{'BACKEND': 'dotted.path', 'OPTIONS': {{...}}}}, "
            f"not a {type(spec).__name__}"
        )
    unknown = [key for key in spec if key not in _SPEC_KEYS]
    if unknown:
        return f"has {_names(unknown)} beside BACKEND and OPTIONS; put publisher options in OPTIONS"
    if not isinstance(spec.get("BACKEND"), str):
        return "needs 'BACKEND', the dotted path of a Publisher subclass"
    if not isinstance(spec.get("OPTIONS", {}), Mapping):
        return f"has OPTIONS that are a {type(spec['OPTIONS']).__name__}, not a dict"
    return None


def parse_spec(pattern: str, spec: Any) -> Route:
    """A route from a dotted path or ``{"BACKEND": path, "OPTIONS": {...}}``."""
    problem = spec_problem(spec)
    if problem is not None:
        raise IdempotencyConfigurationError(f"{route_setting(pattern)} {problem}.")
    if isinstance(spec, str):
        return Route(pattern, spec, {})
    return Route(pattern, spec["BACKEND"], spec.get("OPTIONS", {}))


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
        f"{SETTING}, for example {{{topic!r}: "
        f"'django_idempotency.publishers.celery.CeleryPublisher'}} or {{'*': ...}}."
    )


def options_problem(backend: type[Publisher], options: Mapping[str, Any]) -> str | None:
    """The option names the publisher's signature refuses (unknown, missing), else None."""
    parameters = inspect.signature(backend).parameters.values()
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    unknown = [] if takes_any else [name for name in options if name not in {p.name for p in named}]
    missing = [
        p.name
        for p in parameters
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in options
    ]
    problems = [f"unknown {_names(unknown)}"] if unknown else []
    problems += [f"missing {_names(missing)}"] if missing else []
    return "; ".join(problems) or None


def build(route: Route) -> Publisher:
    """The route's publisher. Errors name the route and the problem, never an option's value."""
    where = route_setting(route.pattern)
    try:
        backend = import_string(route.backend)
    except ImportError as exc:
        raise IdempotencyConfigurationError(
            f"{where}: BACKEND {route.backend!r} could not be imported: {exc}."
        ) from exc
    if not (isinstance(backend, type) and issubclass(backend, Publisher)):
        raise IdempotencyConfigurationError(
            f"{where}: {route.backend!r} is not a Publisher subclass."
        )
    problem = options_problem(backend, route.options)
    if problem is not None:
        raise IdempotencyConfigurationError(
            f"{where}: {backend.__name__} does not accept these OPTIONS: {problem}."
        )
    try:
        return backend(**route.options)
    except IdempotencyConfigurationError as exc:
        # A publisher's own validation: its message is written not to quote values.
        raise IdempotencyConfigurationError(f"{where}: {exc}") from None
    except Exception as exc:
        # Anything else may quote what it was given (a URL with its password): name the type
        # only, and drop the chain so a traceback cannot print it either.
        raise IdempotencyConfigurationError(
            f"{where}: {backend.__name__} does not accept these OPTIONS "
            f"({_names(route.options)}): its constructor raised {type(exc).__name__}."
        ) from None


class PublisherSet:
    """The publishers one relay uses, built on first use and closed together."""

    def __init__(self) -> None:
        self._publishers: dict[Route, Publisher] = {}
        #: Each topic's publisher, for the routes it was resolved from: a relay resolves a
        #: topic once, not once per event (a route's patterns are matched in turn).
        self._by_topic: dict[str, Publisher] = {}
        self._routes: Mapping[str, Any] | None = None

    def for_topic(self, topic: str) -> Publisher:
        routes = conf.OUTBOX_PUBLISHERS
        if routes is not self._routes:  # parsed again: the setting changed
            self._routes, self._by_topic = routes, {}
        publisher = self._by_topic.get(topic)
        if publisher is not None:
            return publisher
        route = resolve_route(topic, routes)
        key = Route(route.pattern, route.backend, _freeze(route.options))
        if key not in self._publishers:
            self._publishers[key] = build(route)
        publisher = self._by_topic[topic] = self._publishers[key]
        return publisher

    def close(self) -> None:
        publishers, self._publishers = list(self._publishers.values()), {}
        self._by_topic = {}
        for publisher in publishers:
            publisher.close()


def _freeze(options: Mapping[str, Any]) -> Any:
    """A hashable stand-in for an options dict, so a route can key the cache."""
    return tuple(sorted((name, repr(value)) for name, value in options.items()))
