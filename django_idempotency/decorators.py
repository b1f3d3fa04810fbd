"""``@idempotent`` for function views: plain Django views and DRF ``@api_view`` functions."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any, TypeVar, overload

from django.http import HttpRequest, HttpResponseBase

from django_idempotency.request import engine

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])


@overload
def idempotent(view: ViewFunc) -> ViewFunc: ...


@overload
def idempotent(
    view: None = None,
    *,
    methods: Collection[str] = ...,
    should_store: Callable[[HttpResponseBase], bool] | None = ...,
    heartbeat: bool | None = ...,
) -> Callable[[ViewFunc], ViewFunc]: ...


def idempotent(
    view: Callable[..., Any] | None = None,
    *,
    methods: Collection[str] = ("POST", "PATCH"),
    should_store: Callable[[HttpResponseBase], bool] | None = None,
    heartbeat: bool | None = None,
) -> Any:
    """Make a function view idempotent for ``methods``.

    With DRF, put it *below* ``@api_view`` so it runs after authentication, permissions and
    throttling::

        @api_view(["POST"])
        @idempotent
        def create_payment(request): ...
    """
    guarded_methods = frozenset(method.upper() for method in methods)
    store = should_store or engine.default_should_store

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
            if request.method not in guarded_methods or _already_guarded(request):
                with engine.atomic_requests():
                    return func(request, *args, **kwargs)
            if hasattr(request, "parser_context"):
                from django_idempotency.drf import run_api_view

                return run_api_view(
                    request, func, args, kwargs, should_store=store, heartbeat=heartbeat
                )
            return engine.process_request(
                request,
                lambda: func(request, *args, **kwargs),
                should_store=store,
                heartbeat=heartbeat,
            )

        # Under @api_view this flag sits on the inner function where Django never looks; with
        # ATOMIC_REQUESTS, put @transaction.non_atomic_requests above @api_view as well.
        return engine.opt_out_of_atomic_requests(wrapper)

    return decorate(view) if view is not None else decorate


def _already_guarded(request: Any) -> bool:
    http_request: HttpRequest = getattr(request, "_request", request)
    return getattr(http_request, "idempotency", None) is not None
