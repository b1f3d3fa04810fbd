"""The test settings with another DEFAULT_AUTO_FIELD: our migrations must not change."""

from tests.settings import *  # noqa: F403

DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
