"""The view of ``tests/db/test_sqlite_locking.py``: the shape of an ordinary create view.

It reads (validation against the database), waits (a slow service), then writes, all in the
transaction the mixin opens around it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.db import OperationalError
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.drf import IdempotencyMixin
from tests.testapp.models import Widget

logger = logging.getLogger(__name__)


class CheckoutView(IdempotencyMixin, APIView):
    def post(self, request: Any) -> Response:
        name = str(request.data.get("name", ""))
        if Widget.objects.filter(name=name).exists():
            return Response({"error": "exists"}, status=409)
        time.sleep(float(request.data.get("think", 0)))
        try:
            widget = Widget.objects.create(name=name)
        except OperationalError as exc:
            logger.warning("checkout %s failed: %s", name, exc)  # the test reads the cause
            raise
        return Response({"id": widget.pk}, status=201)


urlpatterns = [path("checkout/", CheckoutView.as_view())]
