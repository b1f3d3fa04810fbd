"""The hand-off views (``tests/testapp/handoff.py``) and status by key under ``keys/``."""

from tests.testapp.handoff import urlpatterns

__all__ = ["urlpatterns"]
