"""``@idempotent`` for function views: plain Django views (sync or async) and DRF ``@api_view``
functions; ``@idempotent_function`` (``idempotent_function.py``) for any other callable."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.http import HttpResponseBase

from django_idempotency.conf import GUARDED_METHODS
from django_idempotency.request import lifecycle
from django_idempotency.request.fingerprint import DJANGO_LIMIT, BodyLimit
from django_idempotency.request.idempotent_function import idempotent_function

__all__ = ["idempotent", "idempotent_function"]

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
    max_body: BodyLimit = ...,
    wait: float | None = ...,
    long_running: bool = ...,
) -> Callable[[ViewFunc], ViewFunc]: ...


def idempotent(
    view: Callable[..., Any] | None = None,
    *,
    methods: Collection[str] = GUARDED_METHODS,
    should_store: Callable[[HttpResponseBase], bool] | None = None,
    heartbeat: bool | None = None,
    max_body: BodyLimit = DJANGO_LIMIT,
    wait: float | None = None,
    long_running: bool = False,
) -> Any:
    """Make a function view idempotent for ``methods``.

    With DRF, put it *below* ``@api_view`` so it runs after authentication, permissions and
    throttling::

        @api_view(["POST"])
        @idempotent
        def create_payment(request): ...

    An ``async def`` view gets the same guarantees as a sync one. ``max_body`` lets a view
    that reads a large raw body from its stream accept more than Django's
    ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (bytes, or None for no bound): the fingerprint hashes the
    body as it streams and hands it back to the view.

    ``wait``: seconds a duplicate of a request still in flight waits for its answer instead of
    getting 409 at once, when it sends no ``Prefer: wait`` (None: the setting
    ``ATTACH_DEFAULT_WAIT_SECONDS``, 0 by default); see ``docs/howto/attach.md``.

    ``long_running``: the view hands its work to a worker with ``hand_off()`` and answers 202
    (``docs/howto/long-running.md``); a request without a key is then refused 400 whatever
    ``KEY_REQUIRED`` says.
    """
    options = lifecycle.Options(
        methods=frozenset(method.upper() for method in methods),
        should_store=should_store or lifecycle.default_should_store,
        heartbeat=heartbeat,
        max_body=max_body,
        wait=wait,
        long_running=long_running,
    )

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        if iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
                call = functools.partial(func, request, *args, **kwargs)
                return await lifecycle.serve_async(request, call, options, view=func)

            return lifecycle.opt_out_of_atomic_requests(async_wrapper)

        @functools.wraps(func)
        def wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
            if hasattr(request, "parser_context"):  # a DRF Request: below @api_view
                from django_idempotency.drf.mixin import serve_api_view

                return serve_api_view(request, func, args, kwargs, options)
            call = functools.partial(func, request, *args, **kwargs)
            return lifecycle.serve(request, call, options, view=func)

        # Under @api_view this flag sits on the inner function where Django never looks; with
        # ATOMIC_REQUESTS, put @transaction.non_atomic_requests above @api_view as well.
        return lifecycle.opt_out_of_atomic_requests(wrapper)

    return decorate(view) if view is not None else decorate
