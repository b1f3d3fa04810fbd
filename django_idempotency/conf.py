"""The ``IDEMPOTENCY`` settings dict, merged over defaults.

Each setting is parsed on first use and kept until the setting changes (``setting_changed``,
which ``override_settings`` and pytest-django's ``settings`` fixture send, as for DRF's
``api_settings``): the request path reads a dozen settings per request, and reading and
parsing them again each time was a measurable share of a replay's CPU. Nothing is bound at
import, so ``override_settings(IDEMPOTENCY=...)`` just works.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, Generic, Literal, TypeVar

from django.conf import settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from django_idempotency.exceptions import IdempotencyConfigurationError

__all__ = [
    "BOOLEAN_MESSAGE",
    "CREDENTIAL_SCOPE_MESSAGE",
    "DEFAULTS",
    "FALSE_STRINGS",
    "GUARDED_METHODS",
    "HEADER_NAMES_MESSAGE",
    "IdempotencySettings",
    "SENSITIVE_HEADERS",
    "TRUE_STRINGS",
    "conf",
    "import_setting",
    "parse_bool",
    "parse_credential_scope",
    "parse_header_names",
    "parse_int",
    "parse_number",
]

#: The methods guarded unless a view or a setting says otherwise: the non-idempotent ones whose
#: repetition changes something. PUT and DELETE are idempotent by HTTP's own definition.
GUARDED_METHODS = ("POST", "PATCH")

#: Every setting and its default; ``docs/settings.md`` documents each one.
DEFAULTS: dict[str, Any] = {
    # Layer 1: idempotency keys
    "HEADER": "Idempotency-Key",
    "KEY_REQUIRED": True,
    "LEASE_SECONDS": 30,
    "TTL_SECONDS": 86400,
    "SCOPE_RESOLVER": "django_idempotency.request.scopes.user_scope",
    "ANONYMOUS_SCOPE": "anonymous",
    "STORED_STATUS_CODES": range(100, 500),
    "REPLAY_HEADER": "Idempotent-Replay",
    "STORED_RESPONSE_HEADERS": ("Content-Type", "Location"),
    "MAX_RESPONSE_BYTES": 1024 * 1024,
    "LEASE_HEARTBEAT": False,
    "TAKE_OVER_DEAD_OWNERS": True,
    "PREPARED_STATEMENTS": True,
    "MIDDLEWARE_PATHS": (),
    "MIDDLEWARE_METHODS": GUARDED_METHODS,
    "ERROR_TYPE_BASE": "urn:django-idempotency:error:",
    "LOG_KEYS": False,
    # Attach instead of 409: a duplicate of a request in flight may wait for its answer.
    "ATTACH_DEFAULT_WAIT_SECONDS": 0,
    "ATTACH_MAX_WAIT_SECONDS": 10,
    "ATTACH_MAX_WAITERS": 100,
    "ATTACH_MAX_WAITERS_PER_SCOPE": 2,
    "ATTACH_POLL_SECONDS": 0.01,
    # 202 for long operations: how long a worker holds a handed-off key before a retry of the
    # request may take it over (the queue's worst delay plus the work's own time).
    "HANDOFF_HOLD_SECONDS": 3600,
    # Requests whose credentials Django's own middleware does not turn into request.user.
    "CREDENTIAL_HEADERS": ("Authorization",),
    "CREDENTIAL_SCOPE": "digest",
    # The Redis copy: the django-redis cache alias to use, or None for the database only.
    "CACHE_ALIAS": None,
    "CACHE_RETRY_SECONDS": 5,
    # Answers kept in this process's memory for a retry storm (request/memory.py); 0: none.
    "LOCAL_REPLAY_SECONDS": 0,
    "LOCAL_REPLAY_ENTRIES": 1000,
    # Operations: admin registration, Prometheus metrics, OpenTelemetry spans.
    "REGISTER_ADMIN": True,
    "METRICS": True,
    "TRACING": True,
    # Layer 3: transactional outbox
    "OUTBOX_PUBLISHERS": {},
    "OUTBOX_REQUIRE_ATOMIC": True,
    "OUTBOX_KICK": "django_idempotency.tasks.kick_relay",
    "OUTBOX_NOTIFY": True,
    "OUTBOX_BATCH_SIZE": 500,
    "OUTBOX_RELAY_LEASE_SECONDS": 15,
    "OUTBOX_MAX_ATTEMPTS": 10,
    "OUTBOX_BACKOFF_BASE_SECONDS": 1,
    "OUTBOX_BACKOFF_MAX_SECONDS": 600,
    "OUTBOX_POLL_SECONDS": 1,
    "OUTBOX_RETENTION_SECONDS": 7 * 86400,
    # Layer 2: idempotent consumers
    "INBOX_RETENTION_SECONDS": 14 * 86400,
    # Sweeps of all three layers
    "SWEEP_BATCH_SIZE": 1000,
    # Storage at scale (PostgreSQL only): the records, outbox and inbox tables partitioned by day,
    # retention by dropping whole partitions (docs/partitions.md).
    "RECORD_PARTITIONS": False,
    "OUTBOX_PARTITIONS": False,
    "INBOX_PARTITIONS": False,
    "PARTITION_SPAN_DAYS": 1,
    "PARTITION_AHEAD_DAYS": 3,
}

#: Response headers never stored, whatever ``STORED_RESPONSE_HEADERS`` says: replaying them
#: would hand one client another's session or credentials.
SENSITIVE_HEADERS = frozenset(
    {
        "set-cookie",
        "cookie",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
    }
)


#: What a boolean setting may be spelled as, for values read from the environment. Strings are
#: compared stripped and case-folded; ints only as 0 and 1.
TRUE_STRINGS = frozenset({"1", "true", "yes", "on"})
FALSE_STRINGS = frozenset({"0", "false", "no", "off"})
#: Messages shared by the system checks and the errors raised when a setting is read, so
#: ``manage.py check`` and a request say the same. They name the value's type, never the value.
BOOLEAN_MESSAGE = (
    "IDEMPOTENCY[{name!r}] got a {kind} that is not a boolean: use True or False, 1 or 0, or "
    'one of the strings "true", "false", "yes", "no", "on", "off", "1", "0".'
)
CREDENTIAL_SCOPE_MESSAGE = (
    'IDEMPOTENCY[\'CREDENTIAL_SCOPE\'] got a {kind} that is neither "digest" nor "refuse".'
)
HEADER_NAMES_MESSAGE = (
    "IDEMPOTENCY[{name!r}] got a {kind} that is not a list or tuple of header names, such as "
    "('Authorization',)."
)


def _kind(value: Any) -> str:
    """The type of a setting's value, for messages that must not print the value itself."""
    return type(value).__name__


def parse_bool(name: str, value: Any) -> bool:
    """A boolean setting: ``True``/``False``, ``0``/``1``, or a string such as ``"off"``.

    Anything else raises, so ``"false"`` from an environment variable never counts as true.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().casefold()
        if text in TRUE_STRINGS:
            return True
        if text in FALSE_STRINGS:
            return False
    raise IdempotencyConfigurationError(BOOLEAN_MESSAGE.format(name=name, kind=_kind(value)))


def parse_number(name: str, value: Any) -> float:
    """A number setting: an int, a float, or a string of one (``"30"``), never a bool."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = math.nan
    else:
        number = math.nan
    if math.isnan(number):
        raise IdempotencyConfigurationError(
            f"IDEMPOTENCY[{name!r}] got a {_kind(value)} that is not a number: use a number "
            f'such as {DEFAULTS[name]!r}, or a string of one such as "{DEFAULTS[name]}".'
        )
    return number


def parse_int(name: str, value: Any) -> int:
    """A whole-number setting: an int or a string of digits (``"100"``), never a bool."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise IdempotencyConfigurationError(
        f"IDEMPOTENCY[{name!r}] got a {_kind(value)} that is not a whole number: use one such "
        f'as {DEFAULTS[name]!r}, or a string of digits such as "{DEFAULTS[name]}".'
    )


def parse_credential_scope(value: Any) -> Literal["digest", "refuse"]:
    text = value.strip().casefold() if isinstance(value, str) else None
    if text == "digest":
        return "digest"
    if text == "refuse":
        return "refuse"
    raise IdempotencyConfigurationError(CREDENTIAL_SCOPE_MESSAGE.format(kind=_kind(value)))


def parse_header_names(name: str, value: Any) -> tuple[str, ...]:
    """A list or tuple of header names (a lone string is refused: it is not a list)."""
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise IdempotencyConfigurationError(HEADER_NAMES_MESSAGE.format(name=name, kind=_kind(value)))


def import_setting(name: str, value: Any) -> Any:
    """Import a dotted path from a setting; the error names the setting to fix."""
    if not isinstance(value, str):
        return value
    try:
        return import_string(value)
    except ImportError as exc:
        raise IdempotencyConfigurationError(
            f"IDEMPOTENCY[{name!r}] = {value!r} could not be imported: {exc}. "
            f"Set it to the dotted path of an importable object."
        ) from exc


T = TypeVar("T")


class _setting(Generic[T]):  # noqa: N801 - used as a decorator, like property
    """A setting, parsed on first use and kept until ``IDEMPOTENCY`` changes.

    The parsed value is kept in the instance's ``__dict__`` under the setting's name, where it
    hides this descriptor (which defines no ``__set__``): every later read is a plain attribute
    read, with no call at all, on a path that reads a dozen settings per request.
    """

    def __init__(self, parse: Callable[[IdempotencySettings], T]) -> None:
        self.parse = parse
        self.name = parse.__name__
        self.__doc__ = parse.__doc__

    def __get__(self, instance: IdempotencySettings | None, owner: type) -> T:
        if instance is None:
            return self  # type: ignore[return-value]
        # The dict is taken before parsing: a forget() meanwhile keeps the value out of the
        # new one. Not kept when parsing raises: the error is raised again on every use.
        kept = instance.__dict__
        value: T = self.parse(instance)
        kept[self.name] = value
        return value


class IdempotencySettings:
    """View of ``settings.IDEMPOTENCY``: each attribute is its value, parsed, over the default."""

    def forget(self) -> None:
        """Parse every setting again on its next use. A new ``__dict__`` rather than
        ``clear()``: a thread parsing meanwhile stores its value in the old one."""
        self.__dict__ = {}

    @property
    def user_settings(self) -> Mapping[str, Any]:
        value = getattr(settings, "IDEMPOTENCY", {})
        return value if isinstance(value, Mapping) else {}

    def get(self, name: str) -> Any:
        return self.user_settings.get(name, DEFAULTS[name])

    def boolean(self, name: str) -> bool:
        return parse_bool(name, self.get(name))

    def number(self, name: str) -> float:
        return parse_number(name, self.get(name))

    def integer(self, name: str) -> int:
        return parse_int(name, self.get(name))

    @_setting
    def HEADER(self) -> str:
        return str(self.get("HEADER"))

    @_setting
    def KEY_REQUIRED(self) -> bool:
        return self.boolean("KEY_REQUIRED")

    @_setting
    def LEASE_SECONDS(self) -> float:
        return self.number("LEASE_SECONDS")

    @_setting
    def TTL_SECONDS(self) -> float:
        return self.number("TTL_SECONDS")

    @_setting
    def SCOPE_RESOLVER(self) -> Callable[[Any], str]:
        resolver: Callable[[Any], str] = import_setting(
            "SCOPE_RESOLVER", self.get("SCOPE_RESOLVER")
        )
        return resolver

    @_setting
    def ANONYMOUS_SCOPE(self) -> str:
        return str(self.get("ANONYMOUS_SCOPE"))

    @_setting
    def STORED_STATUS_CODES(self) -> Collection[int]:
        codes: Collection[int] = self.get("STORED_STATUS_CODES")
        return codes

    @_setting
    def REPLAY_HEADER(self) -> str:
        return str(self.get("REPLAY_HEADER"))

    @_setting
    def STORED_RESPONSE_HEADERS(self) -> frozenset[str]:
        """Lower-cased allow-list, minus the headers that are never stored."""
        names = {str(name).lower() for name in self.get("STORED_RESPONSE_HEADERS")}
        return frozenset(names - SENSITIVE_HEADERS)

    @_setting
    def MAX_RESPONSE_BYTES(self) -> int:
        return self.integer("MAX_RESPONSE_BYTES")

    @_setting
    def LEASE_HEARTBEAT(self) -> bool:
        return self.boolean("LEASE_HEARTBEAT")

    @_setting
    def MIDDLEWARE_PATHS(self) -> tuple[str, ...]:
        return tuple(self.get("MIDDLEWARE_PATHS"))

    @_setting
    def MIDDLEWARE_METHODS(self) -> frozenset[str]:
        return frozenset(method.upper() for method in self.get("MIDDLEWARE_METHODS"))

    @_setting
    def ERROR_TYPE_BASE(self) -> str:
        return str(self.get("ERROR_TYPE_BASE"))

    @_setting
    def LOG_KEYS(self) -> bool:
        return self.boolean("LOG_KEYS")

    @_setting
    def ATTACH_DEFAULT_WAIT_SECONDS(self) -> float:
        return self.number("ATTACH_DEFAULT_WAIT_SECONDS")

    @_setting
    def ATTACH_MAX_WAIT_SECONDS(self) -> float:
        return self.number("ATTACH_MAX_WAIT_SECONDS")

    @_setting
    def HANDOFF_HOLD_SECONDS(self) -> float:
        return self.number("HANDOFF_HOLD_SECONDS")

    @_setting
    def ATTACH_MAX_WAITERS(self) -> int:
        return self.integer("ATTACH_MAX_WAITERS")

    @_setting
    def ATTACH_MAX_WAITERS_PER_SCOPE(self) -> int:
        return self.integer("ATTACH_MAX_WAITERS_PER_SCOPE")

    @_setting
    def ATTACH_POLL_SECONDS(self) -> float:
        return self.number("ATTACH_POLL_SECONDS")

    @_setting
    def CREDENTIAL_HEADERS(self) -> tuple[str, ...]:
        return parse_header_names("CREDENTIAL_HEADERS", self.get("CREDENTIAL_HEADERS"))

    @_setting
    def CREDENTIAL_SCOPE(self) -> Literal["digest", "refuse"]:
        return parse_credential_scope(self.get("CREDENTIAL_SCOPE"))

    @_setting
    def CACHE_ALIAS(self) -> str | None:
        alias = self.get("CACHE_ALIAS")
        return None if alias is None else str(alias)

    @_setting
    def CACHE_RETRY_SECONDS(self) -> float:
        return self.number("CACHE_RETRY_SECONDS")

    @_setting
    def LOCAL_REPLAY_SECONDS(self) -> float:
        return self.number("LOCAL_REPLAY_SECONDS")

    @_setting
    def LOCAL_REPLAY_ENTRIES(self) -> int:
        return self.integer("LOCAL_REPLAY_ENTRIES")

    @_setting
    def TAKE_OVER_DEAD_OWNERS(self) -> bool:
        return self.boolean("TAKE_OVER_DEAD_OWNERS")

    @_setting
    def PREPARED_STATEMENTS(self) -> bool:
        return self.boolean("PREPARED_STATEMENTS")

    @_setting
    def REGISTER_ADMIN(self) -> bool:
        return self.boolean("REGISTER_ADMIN")

    @_setting
    def METRICS(self) -> bool:
        return self.boolean("METRICS")

    @_setting
    def TRACING(self) -> bool:
        return self.boolean("TRACING")

    @_setting
    def OUTBOX_PUBLISHERS(self) -> Mapping[str, Any]:
        """Topic pattern -> a dotted path, or ``{"BACKEND": path, "OPTIONS": {...}}``."""
        routes: Mapping[str, Any] = self.get("OUTBOX_PUBLISHERS")
        return routes

    @_setting
    def OUTBOX_REQUIRE_ATOMIC(self) -> bool:
        return self.boolean("OUTBOX_REQUIRE_ATOMIC")

    @_setting
    def OUTBOX_KICK(self) -> Callable[[str], None] | None:
        value = self.get("OUTBOX_KICK")
        if value is None:
            return None
        kick: Callable[[str], None] = import_setting("OUTBOX_KICK", value)
        return kick

    @_setting
    def OUTBOX_NOTIFY(self) -> bool:
        return self.boolean("OUTBOX_NOTIFY")

    @_setting
    def OUTBOX_BATCH_SIZE(self) -> int:
        return self.integer("OUTBOX_BATCH_SIZE")

    @_setting
    def OUTBOX_RELAY_LEASE_SECONDS(self) -> float:
        return self.number("OUTBOX_RELAY_LEASE_SECONDS")

    @_setting
    def OUTBOX_MAX_ATTEMPTS(self) -> int:
        return self.integer("OUTBOX_MAX_ATTEMPTS")

    @_setting
    def OUTBOX_BACKOFF_BASE_SECONDS(self) -> float:
        return self.number("OUTBOX_BACKOFF_BASE_SECONDS")

    @_setting
    def OUTBOX_BACKOFF_MAX_SECONDS(self) -> float:
        return self.number("OUTBOX_BACKOFF_MAX_SECONDS")

    @_setting
    def OUTBOX_POLL_SECONDS(self) -> float:
        return self.number("OUTBOX_POLL_SECONDS")

    @_setting
    def OUTBOX_RETENTION_SECONDS(self) -> float:
        return self.number("OUTBOX_RETENTION_SECONDS")

    @_setting
    def INBOX_RETENTION_SECONDS(self) -> float:
        return self.number("INBOX_RETENTION_SECONDS")

    @_setting
    def SWEEP_BATCH_SIZE(self) -> int:
        return self.integer("SWEEP_BATCH_SIZE")

    @_setting
    def RECORD_PARTITIONS(self) -> bool:
        return self.boolean("RECORD_PARTITIONS")

    @_setting
    def OUTBOX_PARTITIONS(self) -> bool:
        return self.boolean("OUTBOX_PARTITIONS")

    @_setting
    def INBOX_PARTITIONS(self) -> bool:
        return self.boolean("INBOX_PARTITIONS")

    @_setting
    def PARTITION_SPAN_DAYS(self) -> int:
        return self.integer("PARTITION_SPAN_DAYS")

    @_setting
    def PARTITION_AHEAD_DAYS(self) -> int:
        return self.integer("PARTITION_AHEAD_DAYS")


conf = IdempotencySettings()


def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "IDEMPOTENCY":
        conf.forget()


setting_changed.connect(_setting_changed, dispatch_uid="django_idempotency.conf")
