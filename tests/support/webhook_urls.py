"""The inbound webhook endpoints (``tests/testapp/webhooks.py``) under ``hooks/``."""

from tests.testapp.webhooks import urlpatterns

__all__ = ["urlpatterns"]
