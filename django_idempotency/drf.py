"""Django REST framework integration: :class:`IdempotencyMixin` for APIView, generic views and
ViewSets.

The claim runs in ``initial()``, after authentication, permissions and throttling, so the scope
can use the user and a 401/403/429 is never stored. The handler then runs with the record's
completion in one ``transaction.atomic``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from django.http import HttpResponseBase
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency.conf import conf
from django_idempotency.exceptions import (
    IdempotencyHTTPError,
    LeaseLost,
    LeaseLostConflict,
    StoreUnavailable,
)
from django_idempotency.request import engine
from django_idempotency.request.fingerprint import (
    hand_over_cleanup,
    prepare_body,
    request_fingerprint,
)
from django_idempotency.request.responses import PROBLEM_CONTENT_TYPE

if TYPE_CHECKING:
    from rest_framework.views import APIView

    _Base = APIView
else:
    _Base = object

__all__ = ["IdempotencyMixin"]


class IdempotencyMixin(_Base):
    """Makes POST and PATCH (``idempotent_methods``) idempotent on any DRF view.

    Override the hooks to change the scope, the fingerprint or which responses are stored.
    """

    #: HTTP methods the mixin guards; the others pass straight through.
    idempotent_methods: Collection[str] = ("POST", "PATCH")
    #: Extend the lease from a background thread while a slow handler runs (None: the setting).
    idempotency_heartbeat: bool | None = None

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        return engine.opt_out_of_atomic_requests(super().as_view(*args, **initkwargs))

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if request.method in self.idempotent_methods:
            return super().dispatch(request, *args, **kwargs)
        with engine.atomic_requests():
            return super().dispatch(request, *args, **kwargs)

    # --- hooks -----------------------------------------------------------------------------

    def get_idempotency_scope(self, request: Request) -> str:
        """The namespace of this request's key; by default ``SCOPE_RESOLVER`` (the user)."""
        return engine.resolve_scope(request)

    def get_idempotency_fingerprint(self, request: Request) -> str:
        """What a retry must repeat: method, path and canonical body."""
        return request_fingerprint(request._request)

    def should_store_response(self, response: HttpResponseBase) -> bool:
        """Whether a response is final; by default its status is in ``STORED_STATUS_CODES``."""
        return engine.default_should_store(response)

    # --- lifecycle -------------------------------------------------------------------------

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        guarded = self._idempotency_guards(request)
        if guarded:
            # Read the body now, before an authentication or permission class can consume the
            # stream, so the fingerprint sees exactly what the handler will.
            prepare_body(request._request)
        super().initial(request, *args, **kwargs)
        if not guarded:
            return
        decision = _claim(
            request,
            scope=lambda: self.get_idempotency_scope(request),
            fingerprint=lambda: self.get_idempotency_fingerprint(request),
        )
        if decision is None:
            return
        handler_name = (request.method or "").lower()
        handler = getattr(self, handler_name)
        if isinstance(decision, engine.Replay):
            replayed = engine.replay(decision)
            setattr(self, handler_name, lambda *a, **k: replayed)
            return
        if not isinstance(decision, engine.Proceed):
            raise engine.refusal(decision)
        lease = decision.lease

        def idempotent_handler(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            return _run(
                self,
                lease,
                lambda: handler(request, *args, **kwargs),
                (request, *args),
                kwargs,
                should_store=self.should_store_response,
                heartbeat=self.idempotency_heartbeat,
            )

        # DRF itself binds ViewSet actions to method names on the instance the same way.
        setattr(self, handler_name, idempotent_handler)

    def finalize_response(
        self, request: Request, response: Any, *args: Any, **kwargs: Any
    ) -> Response:
        finalized = super().finalize_response(request, response, *args, **kwargs)
        hand_over_cleanup(request._request, finalized)
        return finalized

    def handle_exception(self, exc: Exception) -> Response:
        return problem_details(super().handle_exception(exc), exc, self.request)

    def _idempotency_guards(self, request: Request) -> bool:
        method = (request.method or "").lower()
        return (
            request.method in self.idempotent_methods
            and method in self.http_method_names
            and hasattr(self, method)
            and getattr(request._request, "idempotency", None) is None
        )


def run_api_view(
    request: Request,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    should_store: Callable[[HttpResponseBase], bool],
    heartbeat: bool | None,
) -> HttpResponseBase:
    """``@idempotent`` below ``@api_view``: the same lifecycle as the mixin, for a function."""
    view: APIView = request.parser_context["view"]

    def respond() -> HttpResponseBase:
        decision = _claim(
            request,
            scope=lambda: engine.resolve_scope(request),
            fingerprint=lambda: request_fingerprint(request._request),
        )
        if decision is None:
            return func(request, *args, **kwargs)  # type: ignore[no-any-return]
        if isinstance(decision, engine.Replay):
            return engine.replay(decision)
        if not isinstance(decision, engine.Proceed):
            raise engine.refusal(decision)
        return _run(
            view,
            decision.lease,
            lambda: func(request, *args, **kwargs),
            (request, *args),
            kwargs,
            should_store=should_store,
            heartbeat=heartbeat,
        )

    try:
        response = respond()
    except IdempotencyHTTPError as exc:
        response = problem_details(view.handle_exception(exc), exc, request)
    return hand_over_cleanup(request._request, response)


def _claim(
    request: Request, *, scope: Callable[[], str], fingerprint: Callable[[], str]
) -> engine.Decision | None:
    """Claim the request's key; ``None`` when it has none and none is required."""
    key = engine.read_key(request._request)
    if key is None:
        return None
    identity = engine.identify(request._request, key, scope=scope(), fingerprint=fingerprint())
    return engine.claim(identity)


def _run(
    view: APIView,
    lease: engine.Lease,
    call_handler: Callable[[], HttpResponseBase],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    should_store: Callable[[HttpResponseBase], bool],
    heartbeat: bool | None,
) -> HttpResponseBase:
    request = args[0]
    request._request.idempotency = lease

    def call_view() -> HttpResponseBase:
        # Finalize and render inside the transaction, so the stored bytes are the final ones.
        # finalize_response accepts any HttpResponse, not only DRF's Response.
        handler_response: Any = call_handler()
        response = view.finalize_response(request, handler_response, *args[1:], **kwargs)
        if isinstance(response, Response):
            response.render()
        return response

    try:
        return engine.run(lease, call_view, should_store=should_store, heartbeat=heartbeat)
    except LeaseLost as exc:
        raise LeaseLostConflict() from exc
    except engine.UNAVAILABLE_ERRORS as exc:
        raise StoreUnavailable() from exc


def problem_details(response: Response, exc: Exception, request: Any) -> Response:
    """Give our errors their problem+json body, on top of DRF's own exception handling."""
    if not isinstance(exc, IdempotencyHTTPError):
        return response
    response.data = exc.problem(conf.ERROR_TYPE_BASE)
    renderer = getattr(request, "accepted_renderer", None)
    if renderer is None or getattr(renderer, "format", None) == "json":
        response.content_type = PROBLEM_CONTENT_TYPE
    return response
