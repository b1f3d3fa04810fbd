"""The benchmark user, for every variant alike: no query per request, no password hash."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from rest_framework.authentication import BaseAuthentication

BENCH_USER = "bench"


class BenchUserAuthentication(BaseAuthentication):
    user: Any = None

    def authenticate(self, request: Any) -> tuple[Any, None]:
        if BenchUserAuthentication.user is None:
            BenchUserAuthentication.user = get_user_model().objects.get(username=BENCH_USER)
        return BenchUserAuthentication.user, None
