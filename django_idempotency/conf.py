"""The ``IDEMPOTENCY`` settings dict, merged over defaults and read live on every access.

Nothing is cached or bound at import, so ``override_settings(IDEMPOTENCY=...)`` just works.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from django_idempotency.exceptions import IdempotencyConfigurationError

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
    "CREDENTIAL_HEADERS": ("Authorization",),
    "CREDENTIAL_SCOPE": "digest",
    "STORED_STATUS_CODES": range(100, 500),
    "REPLAY_HEADER": "Idempotent-Replay",
    "STORED_RESPONSE_HEADERS": ("Content-Type", "Location"),
    "MAX_RESPONSE_BYTES": 1024 * 1024,
    "LEASE_HEARTBEAT": False,
    "MIDDLEWARE_PATHS": (),
    "MIDDLEWARE_METHODS": GUARDED_METHODS,
    "ERROR_TYPE_BASE": "urn:django-idempotency:error:",
    "LOG_KEYS": False,
    # Redis fast path: the django-redis cache alias to use, or None for the database only.
    "CACHE_ALIAS": None,
    "CACHE_RETRY_SECONDS": 5,
    # Operations: admin registration, Prometheus metrics, OpenTelemetry spans.
    "REGISTER_ADMIN": True,
    "METRICS": True,
    "TRACING": True,
    # Layer 3: transactional outbox
    "OUTBOX_PUBLISHERS": {},
    "OUTBOX_REQUIRE_ATOMIC": True,
    "OUTBOX_KICK": "django_idempotency.tasks.kick_relay",
    "OUTBOX_NOTIFY": True,
    "OUTBOX_BATCH_SIZE": 100,
    "OUTBOX_RELAY_LEASE_SECONDS": 60,
    "OUTBOX_MAX_ATTEMPTS": 10,
    "OUTBOX_BACKOFF_BASE_SECONDS": 1,
    "OUTBOX_BACKOFF_MAX_SECONDS": 600,
    "OUTBOX_POLL_SECONDS": 5,
    "OUTBOX_RETENTION_SECONDS": 7 * 86400,
    # Layer 2: idempotent consumers
    "INBOX_RETENTION_SECONDS": 14 * 86400,
    # Sweeps of all three layers
    "SWEEP_BATCH_SIZE": 1000,
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


class IdempotencySettings:
    """Live view of ``settings.IDEMPOTENCY``: each attribute reads the current value."""

    @property
    def user_settings(self) -> Mapping[str, Any]:
        value = getattr(settings, "IDEMPOTENCY", {})
        return value if isinstance(value, Mapping) else {}

    def get(self, name: str) -> Any:
        return self.user_settings.get(name, DEFAULTS[name])

    @property
    def HEADER(self) -> str:
        return str(self.get("HEADER"))

    @property
    def KEY_REQUIRED(self) -> bool:
        return bool(self.get("KEY_REQUIRED"))

    @property
    def LEASE_SECONDS(self) -> float:
        return float(self.get("LEASE_SECONDS"))

    @property
    def TTL_SECONDS(self) -> float:
        return float(self.get("TTL_SECONDS"))

    @property
    def SCOPE_RESOLVER(self) -> Callable[[Any], str]:
        resolver: Callable[[Any], str] = import_setting(
            "SCOPE_RESOLVER", self.get("SCOPE_RESOLVER")
        )
        return resolver

    @property
    def ANONYMOUS_SCOPE(self) -> str:
        return str(self.get("ANONYMOUS_SCOPE"))

    @property
    def CREDENTIAL_HEADERS(self) -> tuple[str, ...]:
        return tuple(str(name) for name in self.get("CREDENTIAL_HEADERS"))

    @property
    def CREDENTIAL_SCOPE(self) -> str:
        return str(self.get("CREDENTIAL_SCOPE"))

    @property
    def STORED_STATUS_CODES(self) -> Collection[int]:
        codes: Collection[int] = self.get("STORED_STATUS_CODES")
        return codes

    @property
    def REPLAY_HEADER(self) -> str:
        return str(self.get("REPLAY_HEADER"))

    @property
    def STORED_RESPONSE_HEADERS(self) -> frozenset[str]:
        """Lower-cased allow-list, minus the headers that are never stored."""
        names = {str(name).lower() for name in self.get("STORED_RESPONSE_HEADERS")}
        return frozenset(names - SENSITIVE_HEADERS)

    @property
    def MAX_RESPONSE_BYTES(self) -> int:
        return int(self.get("MAX_RESPONSE_BYTES"))

    @property
    def LEASE_HEARTBEAT(self) -> bool:
        return bool(self.get("LEASE_HEARTBEAT"))

    @property
    def MIDDLEWARE_PATHS(self) -> tuple[str, ...]:
        return tuple(self.get("MIDDLEWARE_PATHS"))

    @property
    def MIDDLEWARE_METHODS(self) -> frozenset[str]:
        return frozenset(method.upper() for method in self.get("MIDDLEWARE_METHODS"))

    @property
    def ERROR_TYPE_BASE(self) -> str:
        return str(self.get("ERROR_TYPE_BASE"))

    @property
    def LOG_KEYS(self) -> bool:
        return bool(self.get("LOG_KEYS"))

    @property
    def CACHE_ALIAS(self) -> str | None:
        alias = self.get("CACHE_ALIAS")
        return None if alias is None else str(alias)

    @property
    def CACHE_RETRY_SECONDS(self) -> float:
        return float(self.get("CACHE_RETRY_SECONDS"))

    @property
    def REGISTER_ADMIN(self) -> bool:
        return bool(self.get("REGISTER_ADMIN"))

    @property
    def METRICS(self) -> bool:
        return bool(self.get("METRICS"))

    @property
    def TRACING(self) -> bool:
        return bool(self.get("TRACING"))

    @property
    def OUTBOX_PUBLISHERS(self) -> Mapping[str, Any]:
        """Topic pattern -> a dotted path, or ``{"BACKEND": path, "OPTIONS": {...}}``."""
        routes: Mapping[str, Any] = self.get("OUTBOX_PUBLISHERS")
        return routes

    @property
    def OUTBOX_REQUIRE_ATOMIC(self) -> bool:
        return bool(self.get("OUTBOX_REQUIRE_ATOMIC"))

    @property
    def OUTBOX_KICK(self) -> Callable[[str], None] | None:
        value = self.get("OUTBOX_KICK")
        if value is None:
            return None
        kick: Callable[[str], None] = import_setting("OUTBOX_KICK", value)
        return kick

    @property
    def OUTBOX_NOTIFY(self) -> bool:
        return bool(self.get("OUTBOX_NOTIFY"))

    @property
    def OUTBOX_BATCH_SIZE(self) -> int:
        return int(self.get("OUTBOX_BATCH_SIZE"))

    @property
    def OUTBOX_RELAY_LEASE_SECONDS(self) -> float:
        return float(self.get("OUTBOX_RELAY_LEASE_SECONDS"))

    @property
    def OUTBOX_MAX_ATTEMPTS(self) -> int:
        return int(self.get("OUTBOX_MAX_ATTEMPTS"))

    @property
    def OUTBOX_BACKOFF_BASE_SECONDS(self) -> float:
        return float(self.get("OUTBOX_BACKOFF_BASE_SECONDS"))

    @property
    def OUTBOX_BACKOFF_MAX_SECONDS(self) -> float:
        return float(self.get("OUTBOX_BACKOFF_MAX_SECONDS"))

    @property
    def OUTBOX_POLL_SECONDS(self) -> float:
        return float(self.get("OUTBOX_POLL_SECONDS"))

    @property
    def OUTBOX_RETENTION_SECONDS(self) -> float:
        return float(self.get("OUTBOX_RETENTION_SECONDS"))

    @property
    def INBOX_RETENTION_SECONDS(self) -> float:
        return float(self.get("INBOX_RETENTION_SECONDS"))

    @property
    def SWEEP_BATCH_SIZE(self) -> int:
        return int(self.get("SWEEP_BATCH_SIZE"))


conf = IdempotencySettings()
