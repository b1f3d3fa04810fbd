"""Checks of the operator's tools: the admin, Prometheus metrics and OpenTelemetry tracing
(E060, W060, W061). W062, the sweeps scheduled, is a deploy check."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from django_idempotency.checks import base
from django_idempotency.checks.base import Check, Context, Finding, _not_booleans
from django_idempotency.checks.ids import E060, W060, W061
from django_idempotency.conf import BOOLEAN_MESSAGE, parse_bool
from django_idempotency.exceptions import IdempotencyConfigurationError


def _on_without_package(name: str, module: str) -> Callable[[Context], Iterator[Finding]]:
    """The setting asked for explicitly (a default of True does not insist) but not installed."""

    def condition(c: Context) -> Iterator[Finding]:
        if name not in c.user:
            return
        try:
            wanted = parse_bool(name, c.user[name])
        except IdempotencyConfigurationError:
            return  # E060 says so
        if wanted and not base.importable(module):
            yield {}

    return condition


OPERATIONS_CHECKS: tuple[Check, ...] = (
    Check(E060, _not_booleans("REGISTER_ADMIN", "METRICS", "TRACING"), BOOLEAN_MESSAGE),
    Check(
        W060,
        _on_without_package("METRICS", "prometheus_client"),
        "IDEMPOTENCY['METRICS'] is True but prometheus_client is not installed, so it has no "
        "effect.",
        "Install the 'metrics' extra (pip install -e '/path/to/django-idempotency[metrics]' from "
        "a checkout, see docs/installation.md), or remove the setting.",
    ),
    Check(
        W061,
        _on_without_package("TRACING", "opentelemetry.trace"),
        "IDEMPOTENCY['TRACING'] is True but opentelemetry is not installed, so it has no effect.",
        "Install the 'otel' extra (pip install -e '/path/to/django-idempotency[otel]' from "
        "a checkout, see docs/installation.md), or remove the setting.",
    ),
)
