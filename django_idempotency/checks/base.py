"""What every group of checks is made of: :class:`Check` (one row), :class:`Context` (what its
condition reads), :data:`Finding` (what the condition yields), and the parsing every group shares.

A condition yields one mapping per problem it finds; the row formats its message and hint with
it. A condition never connects to a database unless its row is tagged ``database`` (Django then
runs it only for ``check --database`` and ``migrate``), and never prints a publisher option's
value: options hold signing secrets and broker passwords.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning
from django.utils.module_loading import import_string

from django_idempotency.conf import DEFAULTS, parse_bool, parse_int, parse_number
from django_idempotency.exceptions import IdempotencyConfigurationError

#: The default resolver.
_DEFAULT_RESOLVERS = frozenset({DEFAULTS["SCOPE_RESOLVER"]})

Finding = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Context:
    """What conditions read: ``IDEMPOTENCY`` as given, merged over the defaults, and the
    databases Django asked to check (``None`` unless ``check --database`` or ``migrate``)."""

    user: Mapping[str, Any]
    merged: Mapping[str, Any]
    valid: bool
    databases: Sequence[str] | None

    @classmethod
    def load(cls, databases: Sequence[str] | None) -> Context:
        raw = getattr(settings, "IDEMPOTENCY", {})
        user = raw if isinstance(raw, dict) else {}
        return cls(user, {**DEFAULTS, **user}, isinstance(raw, dict), databases)


@dataclass(eq=False)
class Check:
    """One system check: an Error when its id says ``E``, a Warning when ``W``.

    Registered with Django as a check function (instances are callable), so ``tags`` is also
    the attribute Django's registry sets.
    """

    id: str
    condition: Callable[[Context], Iterable[Finding]]
    message: str
    hint: str | None = None
    tags: tuple[str, ...] = (Tags.compatibility,)
    #: False for checks that do not read ``IDEMPOTENCY``; the others wait for E001 to pass.
    reads_settings: bool = True
    #: Run only by ``check --deploy``: what is fine on a laptop and wrong in production.
    deploy: bool = False

    def __call__(
        self,
        app_configs: Sequence[Any] | None = None,
        databases: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> list[CheckMessage]:
        context = Context.load(databases)
        if self.reads_settings and not context.valid:
            return []
        level = Error if self.id.rpartition(".")[2].startswith("E") else Warning
        return [
            level(
                self.message.format(**found),
                hint=None if self.hint is None else self.hint.format(**found),
                id=self.id,
            )
            for found in self.condition(context)
        ]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(name: str, merged: Mapping[str, Any]) -> float | None:
    try:
        return parse_number(name, merged[name])
    except IdempotencyConfigurationError:
        return None


def _integer(name: str, merged: Mapping[str, Any]) -> int | None:
    try:
        return parse_int(name, merged[name])
    except IdempotencyConfigurationError:
        return None


def _shown(value: Any, number: float | None) -> str:
    """A value for a message: numbers as they are, anything else by its type only."""
    return repr(value) if number is not None else f"a {type(value).__name__}"


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _bad_numbers(
    *names: str, whole: bool = False, zero: bool = False
) -> Callable[[Context], Iterator[Finding]]:
    """Settings that are not numbers (``whole``: integers) above zero (``zero``: or equal)."""
    parse = _integer if whole else _number

    def condition(c: Context) -> Iterator[Finding]:
        for name in names:
            number = parse(name, c.merged)
            if number is None or number < 0 or (number == 0 and not zero):
                yield {
                    "name": name,
                    "value": _shown(c.merged[name], number),
                    "default": DEFAULTS[name],
                }

    return condition


def _not_booleans(*names: str) -> Callable[[Context], Iterator[Finding]]:
    def condition(c: Context) -> Iterator[Finding]:
        for name in names:
            try:
                parse_bool(name, c.merged[name])
            except IdempotencyConfigurationError:
                yield {"name": name, "kind": type(c.merged[name]).__name__}

    return condition


def _importable_callable(
    name: str, *, optional: bool = False
) -> Callable[[Context], Iterator[Finding]]:
    def condition(c: Context) -> Iterator[Finding]:
        value = c.merged[name]
        if value is None and optional:
            return
        try:
            found = import_string(value) if isinstance(value, str) else value
        except ImportError as exc:
            yield {"value": value, "problem": f"does not import: {exc}"}
            return
        if not callable(found):
            yield {"value": value, "problem": "is not callable"}

    return condition


def _is_default_resolver(value: Any) -> bool:
    if isinstance(value, str):
        return value in _DEFAULT_RESOLVERS
    path = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return path in _DEFAULT_RESOLVERS


def _app_models() -> list[Any]:
    from django.apps import apps

    return list(apps.get_app_config("django_idempotency").get_models())
