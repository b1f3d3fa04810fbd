from importlib.util import find_spec

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

__all__ = ["IdempotencyConfig"]


class IdempotencyConfig(AppConfig):
    name = "django_idempotency"
    verbose_name = _("Idempotency")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_idempotency import checks
        from django_idempotency.request import memory, redis_copy  # noqa: F401  (key_released)

        checks.register_all()

        if find_spec("drf_spectacular") is not None:
            # Registers the schema extension that documents idempotent endpoints.
            from django_idempotency.drf import openapi  # noqa: F401

        # Metrics are optional (the "metrics" extra): count only where prometheus_client exists.
        # The receivers read IDEMPOTENCY["METRICS"] on every call, so the setting stays live.
        if checks.importable("prometheus_client"):
            from django_idempotency.observability import metrics

            metrics.connect()
