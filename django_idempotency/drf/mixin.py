"""Django REST framework integration: :class:`IdempotencyMixin` for APIView, generic views and
ViewSets, and the DRF side of ``@idempotent`` below ``@api_view``.

The claim runs in ``initial()``, after authentication, permissions and throttling, so the scope
can use the user and a 401/403/429 is never stored. The handler then runs inside the
lifecycle's transaction, finalized and rendered there, so the stored bytes are the final ones.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from functools import partial, wraps
from typing import TYPE_CHECKING, Any

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.utils.cache import patch_vary_headers
from django.views.generic import View
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.conf import GUARDED_METHODS, conf
from django_idempotency.core.types import (
    Conflict,
    Decision,
    Identity,
    Lease,
    Mismatch,
    Proceed,
    Replay,
    StoredResponse,
)
from django_idempotency.drf.browsable import IdempotentBrowsableAPIRenderer
from django_idempotency.exceptions import IdempotencyHTTPError
from django_idempotency.request import attach, lifecycle
from django_idempotency.request.fingerprint import (
    DJANGO_LIMIT,
    BodyLimit,
    hand_over_cleanup,
    prepare_body,
    request_fingerprint,
)
from django_idempotency.request.responses import PROBLEM_CONTENT_TYPE
from django_idempotency.request.run_step import release
from django_idempotency.request.scopes import credentials_scope, resolve_scope

if TYPE_CHECKING:
    _Base = APIView
else:
    _Base = object

__all__ = ["IdempotencyMixin", "problem_details", "screen", "serve_api_view"]

#: A handler DRF calls with the request and the URL's arguments.
Handler = Callable[..., HttpResponseBase]
#: A key claimed before DRF built its request: what the claim is about, and what it said.
Claimed = tuple[Identity, Decision]


class IdempotencyMixin(_Base):
    """Makes POST and PATCH (``idempotent_methods``) idempotent on any DRF view.

    Override the hooks to change the scope, the fingerprint or which responses are stored.
    """

    #: HTTP methods the mixin guards; the others pass straight through.
    idempotent_methods: Collection[str] = GUARDED_METHODS
    #: Extend the lease from a background thread while a slow handler runs (None: the setting).
    idempotency_heartbeat: bool | None = None
    #: The largest raw body the fingerprint reads (see ``@idempotent``'s ``max_body``).
    idempotency_max_body: BodyLimit = DJANGO_LIMIT
    #: Run DRF's permission and throttle checks before a replay too (off: a replay is the
    #: caller's own stored answer, sent once the caller is authenticated).
    idempotency_recheck_replays: bool = False
    #: Seconds a duplicate of a request in flight waits for its answer instead of a 409, when
    #: it sends no ``Prefer: wait`` (None: ``ATTACH_DEFAULT_WAIT_SECONDS``, 0 by default).
    idempotency_wait: float | None = None
    #: The view hands its work to a worker with ``hand_off()`` and answers 202: a request
    #: without a key is refused 400 whatever ``KEY_REQUIRED`` says.
    idempotency_long_running: bool = False
    #: Scope an API client's keys by a keyed digest of its credentials (``CREDENTIAL_HEADERS``),
    #: as ``IdempotencyMiddleware`` does, instead of by DRF's user: the request alone then tells
    #: its scope, and a replay is sent before DRF's authentication, permissions and throttles.
    #: A new request is still authenticated and checked before its handler runs. Requests
    #: without credentials, or with a Django session user, keep DRF's user.
    idempotency_scope_by_credentials: bool = False

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        view: Any = super().as_view(*args, **initkwargs)
        scoped = initkwargs.get(
            "idempotency_scope_by_credentials", cls.idempotency_scope_by_credentials
        )
        if scoped and not iscoroutinefunction(view):  # async handlers: claimed in dispatch
            view = _claiming_first(view)
        return lifecycle.opt_out_of_atomic_requests(view)

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if request.method not in self.idempotent_methods:
            with lifecycle.atomic_requests():
                return super().dispatch(request, *args, **kwargs)
        # Claimed by the view function before this view was built (_claiming_first), if it was.
        claimed = request.__dict__.pop("_idempotency_claimed", _UNCLAIMED)
        if claimed is _UNCLAIMED:
            claimed = self._claim_before_drf(request)
        if isinstance(claimed, HttpResponseBase):
            return claimed
        self._idempotency_claimed = claimed
        try:
            return super().dispatch(request, *args, **kwargs)
        finally:
            # DRF failed before initial() took the claim: a key claimed for this request is
            # given back, as a request refused before its handler gives it back.
            _release_unused(self.__dict__.pop("_idempotency_claimed", None))

    def _claim_before_drf(
        self, request: HttpRequest
    ) -> HttpResponseBase | Claimed | Exception | None:
        """With ``idempotency_scope_by_credentials``, claim the key before DRF builds its
        request (:func:`_claim_early`); ``None``: claim in :meth:`initial`, as without it.

        The view function keeps what this view's claims need (:class:`_EarlyClaims`) for its
        next requests, which it then claims before it builds the view at all.
        """
        claims = _EarlyClaims.of(self, request)
        if claims is None:
            return None
        door = request.__dict__.pop("_idempotency_first", None)
        if isinstance(door, _ClaimingFirst) and claims.kept:
            door.claims = claims
        return _claim_early(request, claims)

    # --- hooks -----------------------------------------------------------------------------

    def get_idempotency_scope(self, request: Request) -> str:
        """The namespace of this request's key; by default ``SCOPE_RESOLVER`` (the user)."""
        return resolve_scope(request)

    def get_idempotency_fingerprint(self, request: Request) -> str:
        """What a retry must repeat: method, path and canonical body."""
        return request_fingerprint(request._request, max_body=self.idempotency_max_body)

    def should_store_response(self, response: HttpResponseBase) -> bool:
        """Whether a response is final; by default its status is in ``STORED_STATUS_CODES``."""
        return lifecycle.default_should_store(response)

    def get_idempotency_options(self) -> lifecycle.Options:
        return lifecycle.Options(
            methods=frozenset(self.idempotent_methods),
            should_store=self.should_store_response,
            heartbeat=self.idempotency_heartbeat,
            max_body=self.idempotency_max_body,
            wait=self.idempotency_wait,
            long_running=self.idempotency_long_running,
        )

    # --- the door ------------------------------------------------------------------------------

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        """Authenticate, claim the key, then DRF's own checks; a replay skips those checks.

        Authentication comes first because it decides the key's scope, unless the scope is the
        client's credentials (``idempotency_scope_by_credentials``): then a replay skips it too.
        A replay is the caller's own stored answer: it is sent at once, without DRF's permission
        and throttle checks (``idempotency_recheck_replays = True`` runs them first). A request
        that claimed its key and is then refused by a permission or a throttle gives the key
        back, so nothing is stored for it.
        """
        options = self.get_idempotency_options()
        handler_name = (request.method or "").lower()
        handler = (
            getattr(self, handler_name, None) if handler_name in self.http_method_names else None
        )
        if handler is None or not lifecycle.guards(request._request, options):
            super().initial(request, *args, **kwargs)
            return
        # No content negotiation yet: a replay sends stored bytes and needs none, a request
        # that goes on gets DRF's own in initial(), and an error answered before that gets it
        # in handle_exception(). Only the format suffix, which negotiation reads, is set now.
        self.format_kwarg = self.get_format_suffix(**kwargs)
        screen = partial(self.screen_duplicate, request)
        claimed: Claimed | Exception | None = self.__dict__.pop("_idempotency_claimed", None)
        if isinstance(claimed, Exception):  # met before DRF's request (_claim_before_drf)
            raise claimed
        decision: Decision | None
        if claimed is not None:  # claimed before DRF's request
            identity, first = claimed
            decision = lifecycle.follow(request._request, identity, first, options, screen)
        else:
            decision = self._admit(request, options, screen)
        door = _InitialDoor(self, request, args, kwargs, handler, options)
        wrapped = lifecycle.settle(decision, door)
        # DRF itself binds ViewSet actions to method names on the instance the same way.
        setattr(self, handler_name, wrapped)

    def _admit(
        self, request: Request, options: lifecycle.Options, screen: lifecycle.Screen
    ) -> Decision | None:
        # Read the body now, before an authentication or permission class can consume the
        # stream, so the fingerprint sees exactly what the handler will.
        prepare_body(request._request)
        early_scope = (
            credentials_scope(request._request) if self.idempotency_scope_by_credentials else None
        )
        scope: Callable[[], str]
        if early_scope is None:
            self.perform_authentication(request)
            scope = partial(self.get_idempotency_scope, request)
        else:
            scope = partial(str, early_scope)
        return lifecycle.admit(
            request._request,
            scope=scope,
            fingerprint=partial(self.get_idempotency_fingerprint, request),
            options=options,
            screen=screen,
        )

    def screen_duplicate(self, request: Request) -> None:
        """The checks a duplicate passes before it may wait for the request in flight: DRF's
        permissions and throttles, as for a new request (the wait counts against the
        throttle). A refusal raises, for DRF's own 403 or 429."""
        self.check_permissions(request)
        self.check_throttles(request)

    def check_throttles(self, request: Request) -> None:
        """DRF's throttles, once per request: a duplicate that was screened before it waited
        and then runs its handler (the first request failed) counts once."""
        if getattr(self, "_idempotency_throttles_checked", False):
            return
        self._idempotency_throttles_checked = True
        super().check_throttles(request)

    def get_renderers(self) -> list[BaseRenderer]:
        """DRF's own renderers, with its browsable API swapped for one that sends keys.

        DRF's browsable page cannot send a header, so its forms would always get ``400
        idempotency_key_missing`` from a guarded view; subclasses of the renderer (the admin
        renderer, a project's own) are left alone.
        """
        return [
            IdempotentBrowsableAPIRenderer() if type(renderer) is BrowsableAPIRenderer else renderer
            for renderer in super().get_renderers()
        ]

    def finalize_response(
        self, request: Request, response: Any, *args: Any, **kwargs: Any
    ) -> Response:
        finalized = super().finalize_response(request, response, *args, **kwargs)
        attach.preference_applied(request._request, finalized)
        hand_over_cleanup(request._request, finalized)
        return finalized

    def handle_exception(self, exc: Exception) -> Response:
        request = self.request
        if not getattr(request, "accepted_renderer", None):
            # Raised before DRF's initial() negotiated (a refusal, a body Django cannot parse):
            # negotiate now, as DRF's error handling expects, falling back to the first
            # renderer rather than answering 406 instead of the error.
            negotiated = self.perform_content_negotiation(request, force=True)
            request.accepted_renderer, request.accepted_media_type = negotiated
        return problem_details(super().handle_exception(exc), exc, request)


@dataclass(frozen=True, slots=True)
class _InitialDoor:
    """The mixin's answer to each outcome of a claim: the handler DRF is to call in place of
    the view's own (a replay, the handler inside the run step, or the handler unguarded); a
    refusal raises, for DRF's exception handling."""

    view: IdempotencyMixin
    request: Request
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    handler: Callable[..., Any]
    options: lifecycle.Options

    def _drf_initial(self) -> None:
        super(IdempotencyMixin, self.view).initial(self.request, *self.args, **self.kwargs)

    def unkeyed(self) -> Handler:
        self._drf_initial()
        handler = self.handler

        def unguarded(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            return lifecycle.unhandled(partial(handler, request, *args, **kwargs))

        return unguarded

    def replay(self, stored: StoredResponse) -> Handler:
        if self.view.idempotency_recheck_replays:
            self._drf_initial()
        replayed = lifecycle.replay(stored)
        return lambda *args, **kwargs: replayed

    def refuse(self, decision: Conflict | Mismatch) -> Handler:
        raise lifecycle.refusal(decision)

    def proceed(self, lease: Lease) -> Handler:
        try:
            self._drf_initial()
        except BaseException:
            release(lease, "refused")
            raise
        view, handler, options = self.view, self.handler, self.options

        def guarded(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            call = partial(_finalized, view, handler, request, args, kwargs)
            return lifecycle.run(lease, call, options, request=request._request)

        return guarded


#: ``dispatch`` was handed no claim by the view function.
_UNCLAIMED: Any = object()


def _release_unused(claimed: Claimed | Exception | None) -> None:
    """Give back a key claimed for a request DRF then failed to serve before it took it."""
    if isinstance(claimed, tuple) and isinstance(claimed[1], Proceed):
        release(claimed[1].lease, "refused")


@dataclass(frozen=True, slots=True)
class _EarlyClaims:
    """How a view scoped by credentials claims a key before DRF builds its request: the same
    for every request one view function serves, when nothing of the view's class changes it
    per request (``kept``: the view function keeps it and claims before building the view)."""

    #: The claim's own options (the handler's are read again from the view in ``initial``):
    #: with the default ``should_store``, so that nothing kept holds a view, or its request.
    options: lifecycle.Options
    #: The guarded methods the view has a handler for.
    methods: frozenset[str]
    #: DRF's own headers on every answer (``Allow``), set over a replay's stored ones; with
    #: ``vary`` added to its ``Vary`` (DRF's ``finalize_response``). None: the view finalizes.
    headers: dict[str, str] | None
    vary: tuple[str, ...]
    finalize: Callable[[HttpResponseBase], HttpResponseBase] | None
    kept: bool

    @classmethod
    def of(cls, view: IdempotencyMixin, request: HttpRequest) -> _EarlyClaims | None:
        """What ``view``'s claims need before DRF's request; None where they need that
        request: a fingerprint hook of its own, replays rechecked, no credentials scope."""
        kind = type(view)
        if (
            not view.idempotency_scope_by_credentials
            or view.idempotency_recheck_replays
            or kind.get_idempotency_fingerprint is not IdempotencyMixin.get_idempotency_fingerprint
        ):
            return None
        options = replace(
            view.get_idempotency_options(), should_store=lifecycle.default_should_store
        )
        methods = frozenset(
            method
            for method in options.methods
            if method.lower() in view.http_method_names and hasattr(view, method.lower())
        )
        # Kept only where nothing before this claim in the view's own path can differ per
        # request: Django's and DRF's own construction of the view, our dispatch, our options,
        # DRF's own finalizing (whose headers then are the view function's, every time).
        kept = (
            kind.__init__ is View.__init__
            and kind.setup is View.setup
            and kind.dispatch is IdempotencyMixin.dispatch
            and kind.get_idempotency_options is IdempotencyMixin.get_idempotency_options
            and super(IdempotencyMixin, view).finalize_response.__func__  # type: ignore[attr-defined]
            is APIView.finalize_response
            and kind.default_response_headers is APIView.default_response_headers
            and kind.allowed_methods is APIView.allowed_methods
            and getattr(kind, "_allowed_methods", None) is getattr(View, "_allowed_methods", None)
        )
        if not kept:
            return cls(options, methods, None, (), partial(_finalize, view, request), kept=False)
        headers = dict(view.default_response_headers)
        vary = headers.pop("Vary", None)
        varies = tuple(part.strip() for part in vary.split(",")) if vary else ()
        return cls(options, methods, headers, varies, None, kept=True)

    def replay(self, stored: StoredResponse) -> HttpResponseBase:
        """The stored answer as DRF's path would send it: with DRF's own headers."""
        if self.finalize is not None:
            return self.finalize(lifecycle.replay(stored))
        replayed = lifecycle.replay(stored, self.headers)
        if self.vary:
            patch_vary_headers(replayed, self.vary)
        return replayed


def _finalize(
    view: IdempotencyMixin, request: HttpRequest, response: HttpResponseBase
) -> HttpResponseBase:
    """DRF's own finalizing of an HttpResponse (its ``Allow`` and ``Vary``), which reads
    nothing of the request: a replay is the one DRF's path would send."""
    view.headers = view.default_response_headers
    return super(IdempotencyMixin, view).finalize_response(request, response)  # type: ignore[arg-type]


def _claim_early(
    request: HttpRequest, claims: _EarlyClaims
) -> HttpResponseBase | Claimed | Exception | None:
    """Claim the key before DRF's request: a replay is sent from here, with none of DRF's
    work; any other outcome is handed to :meth:`IdempotencyMixin.initial` (``None``: claim
    there, as without the option).

    An error is handed on too: ``initial`` raises it inside DRF's exception handling, which
    answers it.
    """
    if request.method not in claims.methods or not lifecycle.guards(request, claims.options):
        return None
    try:
        prepare_body(request)
        scope = credentials_scope(request)
        if scope is None:
            return None
        fingerprint = partial(request_fingerprint, request, max_body=claims.options.max_body)
        claimed = lifecycle.first_claim(request, partial(str, scope), fingerprint, claims.options)
    except Exception as exc:  # noqa: BLE001 - raised again inside DRF's handling
        return exc
    if claimed is None:
        return None
    decision = claimed[1]
    if isinstance(decision, Replay) and not decision.handed_off:
        replayed = claims.replay(decision.response)
        attach.preference_applied(request, replayed)
        return hand_over_cleanup(request, replayed)
    return claimed


class _ClaimingFirst:
    """What a view function scoped by credentials keeps after its first request: how it claims
    a key (:class:`_EarlyClaims`), filled in by ``dispatch``. A viewset binds its actions per
    route, so what is kept is the view function's, not its class's."""

    __slots__ = ("claims",)

    def __init__(self) -> None:
        self.claims: _EarlyClaims | None = None


def _claiming_first(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
    """``view`` (DRF's view function), claiming a key before it builds the view once it keeps
    how: a replay is then sent before Django and DRF construct the view. It carries ``view``'s
    attributes (``cls``, ``initkwargs``, ``actions``, ``csrf_exempt``) for routers and schema
    tools."""
    kept = _ClaimingFirst()

    @wraps(view)
    def claiming_view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        claims = kept.claims
        if claims is None:
            request._idempotency_first = kept  # type: ignore[attr-defined] # dispatch fills it in
            return view(request, *args, **kwargs)
        if request.method not in claims.methods:
            return view(request, *args, **kwargs)
        claimed = _claim_early(request, claims)
        if isinstance(claimed, HttpResponseBase):
            return claimed
        request._idempotency_claimed = claimed  # type: ignore[attr-defined] # for dispatch
        try:
            return view(request, *args, **kwargs)
        finally:  # building the view failed before dispatch took the claim: given back
            _release_unused(request.__dict__.pop("_idempotency_claimed", None))

    return claiming_view


def screen(
    view_func: Callable[..., Any],
    request: HttpRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> lifecycle.Screen | None:
    """For ``IdempotencyMiddleware`` in front of a DRF view: the view's authentication,
    permissions and throttles, run on a duplicate before it may wait, since the middleware
    claims before DRF's own checks; a refusal is the view's own answer (``Refused``). None
    for a view that is not DRF's."""
    view_class = getattr(view_func, "cls", None)
    if not (isinstance(view_class, type) and issubclass(view_class, APIView)):
        return None
    initkwargs: dict[str, Any] = getattr(view_func, "initkwargs", None) or {}

    def check() -> None:
        view = view_class(**initkwargs)
        view.args, view.kwargs = args, kwargs
        drf_request = view.initialize_request(request, *args, **kwargs)
        view.request, view.headers = drf_request, view.default_response_headers
        try:
            view.perform_authentication(drf_request)
            view.check_permissions(drf_request)
            view.check_throttles(drf_request)
        except Exception as exc:
            response = view.finalize_response(drf_request, view.handle_exception(exc))
            if isinstance(response, Response):
                response.render()
            raise lifecycle.Refused(response) from exc

    return check


def serve_api_view(
    request: Request,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: lifecycle.Options,
) -> HttpResponseBase:
    """``@idempotent`` below ``@api_view``: the lifecycle, with DRF's user and error handling."""
    view: APIView = request.parser_context["view"]

    def error_response(error: IdempotencyHTTPError) -> HttpResponseBase:
        return problem_details(view.handle_exception(error), error, request)

    return lifecycle.serve(
        request._request,
        partial(_finalized, view, func, request, args, kwargs),
        options,
        view=func,
        scope=partial(resolve_scope, request),
        fingerprint=partial(request_fingerprint, request._request, max_body=options.max_body),
        error_response=error_response,
    )


def _finalized(
    view: APIView,
    handler: Callable[..., Any],
    request: Request,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> HttpResponseBase:
    """The handler's response as DRF will send it: finalized and rendered, so the bytes stored
    inside the transaction are the final ones. finalize_response accepts any HttpResponse."""
    response = view.finalize_response(request, handler(request, *args, **kwargs), *args, **kwargs)
    if isinstance(response, Response):
        response.render()
    return response


def problem_details(response: Response, exc: Exception, request: Any) -> Response:
    """Give our errors their problem+json body, on top of DRF's own exception handling."""
    if not isinstance(exc, IdempotencyHTTPError):
        return response
    response.data = exc.problem(conf.ERROR_TYPE_BASE)
    renderer = getattr(request, "accepted_renderer", None)
    if renderer is None or getattr(renderer, "format", None) == "json":
        response.content_type = PROBLEM_CONTENT_TYPE
    return response
