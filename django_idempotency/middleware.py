"""``IdempotencyMiddleware``: idempotency keys for views you do not decorate, chosen by path.

Put it after ``AuthenticationMiddleware`` so the default scope sees the user. Only paths that
match one of ``MIDDLEWARE_PATHS`` (regular expressions, searched in ``request.path_info``) and
methods in ``MIDDLEWARE_METHODS`` are guarded. Views behind it that also use the mixin or the
decorator are guarded once, here.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from functools import lru_cache
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponseBase

from django_idempotency.conf import conf
from django_idempotency.request import engine


@lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


class IdempotencyMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        if not self.guards(request):
            return self.get_response(request)
        return engine.process_request(request, lambda: self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
        if not self.guards(request):
            return await get_response(request)
        # The view's transaction must live in one thread. Run the state machine in the thread
        # that Django's async ORM calls use (thread_sensitive), and the async view inside it:
        # its sync_to_async database calls then execute in this same thread, inside the
        # transaction that also stores the response.
        return await sync_to_async(self._process_in_thread, thread_sensitive=True)(request)

    def _process_in_thread(self, request: HttpRequest) -> HttpResponseBase:
        call_view = async_to_sync(self.get_response)
        return engine.process_request(request, lambda: call_view(request))

    def guards(self, request: HttpRequest) -> bool:
        if request.method not in conf.MIDDLEWARE_METHODS:
            return False
        path = request.path_info
        return any(_compile(pattern).search(path) for pattern in conf.MIDDLEWARE_PATHS)
