"""``@idempotent`` for Django Ninja operations, sync and async: a door into the lifecycle.

Put it *below* the operation's decorator, next to the function::

    @api.post("/payments", response={201: PaymentOut}, auth=django_auth)
    @idempotent
    def create_payment(request, payload: PaymentIn): ...

Ninja authenticates, throttles and validates first (a 401, 429 or Ninja's own 422 is never
stored, and no key is claimed for it); then the lifecycle claims the key, scoped by Ninja's auth
(:func:`~django_idempotency.ninja.scopes.ninja_scope`), and answers a replay, a 409 with
Retry-After or a 422 ``payload_mismatch`` with the problem+json bodies every door gives; or runs
the operation and turns its result into Ninja's response inside the transaction that stores it,
so the stored bytes are the ones sent. The operation's OpenAPI documents the key header and those
answers.

How it finds Ninja's operation: a ``decorate_view`` decorator (re-applied by Ninja to each mount
of a router) notes the operation running; its result is turned into a response by
``Operation._result_to_response``, the one private Ninja method used, as Ninja itself would.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Collection
from contextvars import ContextVar
from typing import Any, overload

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from ninja.decorators import decorate_view
from ninja.operation import Operation
from ninja.utils import contribute_operation_callback

from django_idempotency.conf import GUARDED_METHODS
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.ninja.openapi import document
from django_idempotency.ninja.scopes import ninja_scope
from django_idempotency.request import lifecycle
from django_idempotency.request.fingerprint import request_fingerprint

__all__ = ["idempotent"]

Scope = Callable[[HttpRequest], str]

#: The Ninja operation running in this context, noted by :func:`_note_operation`.
_running: ContextVar[Operation | None] = ContextVar("django_idempotency_ninja", default=None)


@overload
def idempotent(func: Callable[..., Any]) -> Callable[..., Any]: ...


@overload
def idempotent(
    func: None = None,
    *,
    methods: Collection[str] = ...,
    should_store: Callable[[HttpResponseBase], bool] | None = ...,
    heartbeat: bool | None = ...,
    wait: float | None = ...,
    scope: Scope | None = ...,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


def idempotent(
    func: Callable[..., Any] | None = None,
    *,
    methods: Collection[str] = GUARDED_METHODS,
    should_store: Callable[[HttpResponseBase], bool] | None = None,
    heartbeat: bool | None = None,
    wait: float | None = None,
    scope: Scope | None = None,
) -> Any:
    """Make a Ninja operation idempotent for ``methods`` (POST and PATCH by default).

    ``should_store``, ``heartbeat`` and ``wait`` are ``@idempotent``'s for function views.
    ``scope``: a function of the request giving the namespace of its keys; by default
    :func:`~django_idempotency.ninja.scopes.ninja_scope` (Ninja's authenticated caller).
    """
    options = lifecycle.Options(
        methods=frozenset(method.upper() for method in methods),
        should_store=should_store or lifecycle.default_should_store,
        heartbeat=heartbeat,
        wait=wait,
    )
    scope_of = scope or ninja_scope

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        if hasattr(view, "_ninja_operation"):
            raise IdempotencyConfigurationError(
                f"@idempotent on {view.__qualname__} sits above Ninja's @api.<method>(...): put "
                "it below, next to the function, so that Ninja calls it."
            )
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                operation = _operation(view)

                async def call() -> HttpResponseBase:
                    result = await view(request, *args, **kwargs)
                    return _response(operation, request, result, kwargs)

                return await lifecycle.serve_async(
                    request,
                    call,
                    options,
                    view=view,
                    scope=functools.partial(scope_of, request),
                    fingerprint=functools.partial(request_fingerprint, request),
                )

            wrapper: Callable[..., Any] = async_wrapper
        else:

            @functools.wraps(view)
            def sync_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                operation = _operation(view)

                def call() -> HttpResponseBase:
                    return _response(operation, request, view(request, *args, **kwargs), kwargs)

                return lifecycle.serve(
                    request,
                    call,
                    options,
                    view=view,
                    scope=functools.partial(scope_of, request),
                    fingerprint=functools.partial(request_fingerprint, request),
                )

            wrapper = sync_wrapper
        # Ninja reads the parameters from the signature and resolves string annotations (``from
        # __future__ import annotations``) in the wrapper's module: resolve them in the view's.
        # A name imported only for type checkers stays a string: Ninja reports it itself.
        with contextlib.suppress(NameError):
            wrapper.__signature__ = inspect.signature(view, eval_str=True)  # type: ignore[attr-defined]
        # functools.wraps shares the view's list of Ninja callbacks: ours go on a copy.
        callbacks = getattr(view, "_ninja_contribute_to_operation", None)
        if callbacks is not None:
            wrapper._ninja_contribute_to_operation = list(callbacks)  # type: ignore[attr-defined]
        contribute_operation_callback(wrapper, functools.partial(document, options))
        return decorate_view(_note_operation)(wrapper)

    return decorate(func) if func is not None else decorate


def _note_operation(run: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Ninja's ``Operation.run`` (``decorate_view``) to note which operation runs."""
    operation = getattr(inspect.unwrap(run), "__self__", None)
    if not isinstance(operation, Operation):
        raise IdempotencyConfigurationError(
            "django_idempotency.ninja could not find the Ninja operation it guards; put "
            "@idempotent directly below @api.<method>(...), below any @decorate_view."
        )
    if iscoroutinefunction(run):

        @functools.wraps(run)
        async def async_run(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            token = _running.set(operation)
            try:
                return await run(request, *args, **kwargs)
            finally:
                _running.reset(token)

        return async_run

    @functools.wraps(run)
    def sync_run(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        token = _running.set(operation)
        try:
            return run(request, *args, **kwargs)
        finally:
            _running.reset(token)

    return sync_run


def _operation(view: Callable[..., Any]) -> Operation:
    operation = _running.get()
    if operation is None:
        raise IdempotencyConfigurationError(
            f"{view.__qualname__} is guarded by django_idempotency.ninja's @idempotent but was "
            "called outside a Ninja operation; call it through the API."
        )
    return operation


def _response(
    operation: Operation, request: HttpRequest, result: Any, values: dict[str, Any]
) -> HttpResponseBase:
    """The operation's result as the response Ninja will send, headers and cookies set on a
    ``response: HttpResponse`` parameter included."""
    if isinstance(result, HttpResponseBase):
        return result
    response_arg = operation.signature.response_arg
    temporal = values.get(response_arg) if response_arg else None
    if temporal is None:
        temporal = operation.api.create_temporal_response(request)
    return operation._result_to_response(request, result, temporal)
