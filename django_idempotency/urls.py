"""``include("django_idempotency.urls")``: status and result by key
(``docs/howto/status-by-key.md``).

The DRF views (``drf/views.py``) when DRF is installed, so token and session clients are scoped
after DRF's authentication as their writes were; the plain Django views (``views.py``) otherwise.
"""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec

from django.urls import re_path

_views = import_module(
    "django_idempotency.drf.views"
    if find_spec("rest_framework") is not None
    else "django_idempotency.request.status"
)

#: Any characters: a key may hold what a path converter would refuse (a newline is not a valid
#: key, and must be the views' 404 like any other, not Django's own).
_KEY = r"(?P<key>[\s\S]+)"

urlpatterns = [
    # The response first: a key may contain "/", and the status route would match it too.
    re_path(
        rf"^idempotency-keys/{_KEY}/response$",
        _views.KeyResponseView.as_view(),
        name="idempotency-key-response",
    ),
    re_path(
        rf"^idempotency-keys/{_KEY}$",
        _views.KeyStatusView.as_view(),
        name="idempotency-key-status",
    ),
]
