"""``IdempotencyMiddleware``: idempotency keys for views you do not decorate, chosen by path.

It guards a request from ``process_view``: after URL resolution (a path that resolves to no view
is never claimed, and its body never read), after every other middleware's request phase
(sessions, authentication), and after the ``process_view`` of the middleware listed before it
(CSRF). It then calls the resolved view itself, inside the claim's transactions, the way
``@idempotent`` does. So put it **last** in ``MIDDLEWARE``: a ``process_view`` of a middleware
listed after it would be skipped for guarded requests (system check E013 says so).

A duplicate of a request in flight that asks to wait (``Prefer: wait``) for a DRF view must first
pass that view's authentication, permissions and throttles, as the request itself will; a
refusal is the view's own 401, 403 or 429, at once.

Only paths that match one of ``MIDDLEWARE_PATHS`` (regular expressions, searched in
``request.path_info``) and methods in ``MIDDLEWARE_METHODS`` are guarded. Views behind it that
also use the mixin or the decorator are guarded once, here. Views marked
:func:`idempotency_exempt` (every ``idempotent_webhook`` is) are left alone: they deduplicate by
other means, and their callers send no key.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from functools import lru_cache, partial
from typing import Any, TypeVar

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase

from django_idempotency.conf import conf
from django_idempotency.request import lifecycle

__all__ = ["IdempotencyMiddleware", "idempotency_exempt"]

ViewT = TypeVar("ViewT", bound=Callable[..., Any])


def idempotency_exempt(view: ViewT) -> ViewT:
    """Keep ``IdempotencyMiddleware`` off ``view`` even where ``MIDDLEWARE_PATHS`` matches it.

    For a view that deduplicates by other means, whose callers send no ``Idempotency-Key``:
    :func:`~django_idempotency.inbox.webhooks.idempotent_webhook` marks its views so.
    """
    view.idempotency_exempt = True  # type: ignore[attr-defined]
    return view


@lru_cache(maxsize=8)
def _compile(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """``MIDDLEWARE_PATHS`` compiled, once per value of the setting."""
    return tuple(re.compile(pattern) for pattern in patterns)


@lru_cache(maxsize=8)
def _options(methods: frozenset[str]) -> lifecycle.Options:
    """The lifecycle's options for ``MIDDLEWARE_METHODS``, made once per value of the setting."""
    return lifecycle.Options(methods=methods)


def _screen(
    view_func: Callable[..., Any],
    request: HttpRequest,
    view_args: tuple[Any, ...],
    view_kwargs: dict[str, Any],
) -> None:
    """A DRF view's own checks, which a duplicate must pass before it may wait (``drf.screen``);
    nothing for other views. Bound per request and run only when a duplicate would wait."""
    if getattr(view_func, "cls", None) is None:
        return
    try:
        from django_idempotency.drf.mixin import screen
    except ImportError:  # pragma: no cover - a view with .cls but no DRF installed
        return
    check = screen(view_func, request, view_args, view_kwargs)
    if check is not None:
        check()


def _call_view(
    view_func: Callable[..., Any],
    request: HttpRequest,
    view_args: tuple[Any, ...],
    view_kwargs: dict[str, Any],
) -> HttpResponseBase:
    """The view, an async one through ``async_to_sync``: told apart only when the view runs,
    so a replay, which runs none, does not pay for it."""
    view = async_to_sync(view_func) if iscoroutinefunction(view_func) else view_func
    response: HttpResponseBase = view(request, *view_args, **view_kwargs)
    return response


class IdempotencyMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
            # Django adapts process_view to the handler by its own kind: an async one is
            # awaited on the event loop, so a duplicate that waits does it there.
            self.process_view = self.process_view_async  # type: ignore[method-assign,assignment]

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
        return await get_response(request)

    def process_view(
        self,
        request: HttpRequest,
        view_func: Callable[..., Any],
        view_args: tuple[Any, ...],
        view_kwargs: dict[str, Any],
    ) -> HttpResponseBase | None:
        """Serve a guarded request through the lifecycle; leave the others to Django.

        Under ASGI :meth:`process_view_async` takes its place, and runs the lifecycle in the
        thread Django's async ORM calls use; an async view is called from it with
        ``async_to_sync``, so the view's database calls and the response's storage share one
        transaction.
        """
        if not self.guards(request) or getattr(view_func, "idempotency_exempt", False):
            return None
        options = self.options()
        if not lifecycle.guards(request, options):
            return None
        call: Callable[[], HttpResponseBase] = partial(
            _call_view, view_func, request, view_args, view_kwargs
        )
        screen = partial(_screen, view_func, request, view_args, view_kwargs)
        return lifecycle.serve(request, call, options, view=view_func, screen=screen)

    async def process_view_async(
        self,
        request: HttpRequest,
        view_func: Callable[..., Any],
        view_args: tuple[Any, ...],
        view_kwargs: dict[str, Any],
    ) -> HttpResponseBase | None:
        """:meth:`process_view` under ASGI: the lifecycle and the view run in the thread the
        async ORM calls use, as there; a duplicate that waits for a request in flight waits on
        the event loop."""
        if not self.guards(request) or getattr(view_func, "idempotency_exempt", False):
            return None
        options = self.options()
        if not lifecycle.guards(request, options):
            return None
        screen = partial(_screen, view_func, request, view_args, view_kwargs)
        if iscoroutinefunction(view_func):
            return await lifecycle.serve_async(
                request, partial(view_func, request, *view_args, **view_kwargs), options,
                view=view_func, screen=screen,
            )  # fmt: skip
        return await lifecycle.serve_sync_view_async(
            request, partial(view_func, request, *view_args, **view_kwargs), options,
            view=view_func, screen=screen,
        )  # fmt: skip

    def options(self) -> lifecycle.Options:
        """The lifecycle's options for guarded requests, as the settings say now."""
        return _options(conf.MIDDLEWARE_METHODS)

    def guards(self, request: HttpRequest) -> bool:
        """Whether ``MIDDLEWARE_PATHS`` and ``MIDDLEWARE_METHODS`` select this request."""
        if request.method not in conf.MIDDLEWARE_METHODS:
            return False
        path = request.path_info
        return any(pattern.search(path) for pattern in _compile(conf.MIDDLEWARE_PATHS))
