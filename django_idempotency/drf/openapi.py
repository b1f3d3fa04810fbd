"""OpenAPI for idempotent endpoints, with drf-spectacular (the ``openapi`` extra).

Every operation that :class:`~django_idempotency.drf.IdempotencyMixin` guards documents the
``Idempotency-Key`` request header, the ``Idempotent-Replay`` header on its own responses, and the
problem+json answers the state machine can give instead: 400, 409 (with ``Retry-After``), 422 and
503. A 400 has two shapes, told apart by the media type: a key error in
``application/problem+json``, or DRF's own error body in ``application/json`` (the field errors
of a request that failed validation). The app loads this module when drf-spectacular is
installed; there is nothing to configure.

A function view decorated with ``@idempotent`` is documented the same way when it names the
schema explicitly, since a function carries no class to recognise::

    @api_view(["POST"])
    @schema(IdempotentAutoSchema())
    @idempotent
    def create_payment(request): ...
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from drf_spectacular.drainage import get_view_method_names, isolate_view_method
from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ComponentRegistry, ResolvedComponent, get_class
from rest_framework.views import APIView

from django_idempotency.conf import conf
from django_idempotency.request.openapi import (
    KEY_PATTERN,
    PROBLEM_COMPONENT,
    STATE_ERRORS,
    key_parameter,
    problem_schema,
)
from django_idempotency.request.openapi import replay_header as _replay_header
from django_idempotency.request.openapi import retry_after_header as _retry_after_header
from django_idempotency.request.responses import PROBLEM_CONTENT_TYPE

# KEY_PATTERN, PROBLEM_COMPONENT, key_parameter and problem_schema are the framework-free ones
# of request/openapi.py, shared with the Ninja door.
__all__ = [
    "KEY_PATTERN",
    "PROBLEM_COMPONENT",
    "IdempotentAutoSchema",
    "IdempotentSchemaMixin",
    "document_operation",
    "key_parameter",
    "problem_schema",
]
DRF_ERRORS_COMPONENT = "DRFErrors"
JSON_CONTENT_TYPE = "application/json"

#: status -> (error codes the body may carry, description, whether Retry-After is sent)
ERROR_RESPONSES: dict[int, tuple[tuple[str, ...], str, bool]] = {
    **STATE_ERRORS,
    400: (
        STATE_ERRORS[400][0],
        "The idempotency key is missing or malformed (application/problem+json), or the request "
        "failed validation (application/json: DRF's field errors). Nothing was done and nothing "
        "was stored: fix the request and send it again, with the same key.",
        False,
    ),
}


def drf_errors_schema() -> dict[str, Any]:
    """DRF's error body for a 400 it raised: what ``exception_handler`` renders from a
    ``ValidationError`` (or a ``ParseError``)."""
    messages = {"type": "array", "items": {}}
    return {
        "description": (
            "DRF's error body: an object with a list of messages per field (`non_field_errors` "
            "for the request as a whole; nested objects for nested serializers), `detail` for "
            "a body that could not be parsed, or a bare list of messages."
        ),
        "oneOf": [
            {
                "type": "object",
                "additionalProperties": {
                    "oneOf": [messages, {"type": "object"}, {"type": "string"}]
                },
            },
            {"type": "array", "items": {"type": "string"}},
        ],
    }


def document_operation(operation: dict[str, Any], registry: ComponentRegistry) -> None:
    """Add the key header and the idempotency answers to one generated operation, in place.

    What the view documents itself wins: an existing parameter or media type is left alone.
    """
    component = _component(registry, PROBLEM_COMPONENT, problem_schema())
    drf_errors = _component(registry, DRF_ERRORS_COMPONENT, drf_errors_schema())

    parameters = operation.setdefault("parameters", [])
    header = conf.HEADER.lower()
    if not any(p.get("in") == "header" and p.get("name", "").lower() == header for p in parameters):
        parameters.append(key_parameter())

    responses = operation.setdefault("responses", {})
    for status, response in responses.items():
        if str(status).startswith("2"):
            response.setdefault("headers", {}).setdefault(conf.REPLAY_HEADER, _replay_header())
    for status, (_, description, retry_after) in ERROR_RESPONSES.items():
        response = responses.setdefault(str(status), {"description": description})
        response.setdefault("content", {}).setdefault(
            PROBLEM_CONTENT_TYPE, {"schema": component.ref}
        )
        if retry_after:
            response.setdefault("headers", {}).setdefault("Retry-After", _retry_after_header())
    responses["400"]["content"].setdefault(JSON_CONTENT_TYPE, {"schema": drf_errors.ref})


def _component(registry: ComponentRegistry, name: str, schema: dict[str, Any]) -> Any:
    component = ResolvedComponent(  # type: ignore[no-untyped-call]
        name=name, type=ResolvedComponent.SCHEMA, object=name, schema=schema
    )
    registry.register_on_missing(component)
    return component


class IdempotentSchemaMixin:
    """Mixed in front of a view's own AutoSchema class; documents the guarded methods."""

    #: Methods to document when the view does not say (function views): ``@idempotent``'s default.
    idempotent_methods: Collection[str] = ("POST", "PATCH")

    def __init__(self, *args: Any, methods: Collection[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if methods is not None:
            self.idempotent_methods = tuple(method.upper() for method in methods)

    def get_operation(
        self,
        path: str,
        path_regex: str,
        path_prefix: str,
        method: str,
        registry: ComponentRegistry,
    ) -> dict[str, Any] | None:
        operation: dict[str, Any] | None = super().get_operation(  # type: ignore[misc]
            path, path_regex, path_prefix, method, registry
        )
        view = getattr(self, "view", None)
        methods = getattr(view, "idempotent_methods", self.idempotent_methods)
        if operation is not None and method.upper() in methods:
            document_operation(operation, registry)
        return operation


class IdempotentAutoSchema(IdempotentSchemaMixin, AutoSchema):
    """drf-spectacular's AutoSchema for a function view guarded by ``@idempotent``.

    Pass ``methods=`` when the decorator was given other methods than POST and PATCH.
    """


#: One extended class per base schema class, so repeated schema generation creates no new ones.
_schema_classes: dict[type[Any], type[Any]] = {}


def _idempotent_schema_class(schema_class: type[Any]) -> type[Any]:
    if issubclass(schema_class, IdempotentSchemaMixin):
        return schema_class
    if schema_class not in _schema_classes:
        _schema_classes[schema_class] = type(
            f"Idempotent{schema_class.__name__}", (IdempotentSchemaMixin, schema_class), {}
        )
    return _schema_classes[schema_class]


class IdempotencyMixinExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Gives every view using IdempotencyMixin its own schema class, extended as above."""

    target_class = "django_idempotency.drf.IdempotencyMixin"
    match_subclasses = True

    def view_replacement(self) -> type[APIView]:
        view_class: type[APIView] = self.target
        schema = view_class.schema  # the view's inspector, or None when excluded from the schema
        if schema is None:
            return view_class
        schema_class = _idempotent_schema_class(type(schema))
        replacement: type[APIView] = type(
            view_class.__name__,
            (view_class,),
            {"schema": schema_class(), "__module__": view_class.__module__},
        )
        # An action decorated with extend_schema brings its own schema class, which replaces the
        # view's: extend that one too, on a copy of the action so the original view is untouched.
        for name in get_view_method_names(replacement, schema=replacement.schema):
            action_schema = getattr(getattr(replacement, name), "kwargs", {}).get("schema")
            if action_schema is not None:
                action = isolate_view_method(replacement, name)  # type: ignore[no-untyped-call]
                action.kwargs["schema"] = _idempotent_schema_class(get_class(action_schema))
        return replacement


# --- status and result by key (django_idempotency.urls) ----------------------------------------

KEY_STATUS_COMPONENT = "IdempotencyKeyStatus"


def key_status_schema() -> dict[str, Any]:
    """The body of ``GET idempotency-keys/<key>`` (``views.key_status``)."""
    return {
        "type": "object",
        "properties": {
            "key": {"type": "string"},
            "status": {"type": "string", "enum": ["processing", "completed"]},
            "response_status": {
                "type": "integer",
                "nullable": True,
                "description": "The stored response's status; null while processing.",
            },
            "created": {"type": "string", "format": "date-time"},
            "expires": {
                "type": "string",
                "format": "date-time",
                "description": "After this the key is forgotten (404) and may be used again.",
            },
        },
        "required": ["key", "status", "response_status", "created", "expires"],
    }


def _no_store_header() -> dict[str, Any]:
    return {
        "schema": {"type": "string", "enum": ["no-store"]},
        "description": "The answer concerns one client's key: never cached.",
    }


def _not_found(problem: Any) -> dict[str, Any]:
    return {
        "description": (
            "No live key by this name in your scope: never used with your credentials, "
            "expired, released, not a valid key, or another client's. The answer is the same "
            "in every case."
        ),
        "content": {PROBLEM_CONTENT_TYPE: {"schema": problem.ref}},
        "headers": {"Cache-Control": _no_store_header()},
    }


def _unavailable(problem: Any) -> dict[str, Any]:
    return {
        "description": "The database that records keys is unavailable: ask again after "
        "Retry-After seconds.",
        "content": {PROBLEM_CONTENT_TYPE: {"schema": problem.ref}},
        "headers": {"Retry-After": _retry_after_header(), "Cache-Control": _no_store_header()},
    }


def key_status_responses(registry: ComponentRegistry) -> dict[str, Any]:
    problem = _component(registry, PROBLEM_COMPONENT, problem_schema())
    status = _component(registry, KEY_STATUS_COMPONENT, key_status_schema())
    return {
        "200": {
            "description": (
                'The key\'s state. Once completed, `Link: <…/response>; rel="response"` points '
                "to the stored response."
            ),
            "content": {JSON_CONTENT_TYPE: {"schema": status.ref}},
            "headers": {
                "Link": {
                    "schema": {"type": "string"},
                    "description": "Sent once completed: the URL of the stored response.",
                },
                "Cache-Control": _no_store_header(),
            },
        },
        "404": _not_found(problem),
        "503": _unavailable(problem),
    }


def key_response_responses(registry: ComponentRegistry) -> dict[str, Any]:
    problem = _component(registry, PROBLEM_COMPONENT, problem_schema())
    replayed = {
        "content": {"*/*": {"schema": {}}},
        "headers": {conf.REPLAY_HEADER: _replay_header(), "Cache-Control": _no_store_header()},
    }
    return {
        "200": {
            "description": "The stored response, byte for byte, as a retry would receive it.",
            **replayed,
        },
        "404": _not_found(problem),
        "409": {
            "description": "The request holding the key is still running: ask again after "
            "Retry-After seconds.",
            "content": {PROBLEM_CONTENT_TYPE: {"schema": problem.ref}},
            "headers": {"Retry-After": _retry_after_header(), "Cache-Control": _no_store_header()},
        },
        "503": _unavailable(problem),
        "default": {
            "description": "The stored response, when its status was not 200: the same status, "
            "headers and body the first request received.",
            **replayed,
        },
    }


def key_path_parameter() -> dict[str, Any]:
    return {
        "in": "path",
        "name": "key",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        "description": (
            "The key as the request sent it (without the quotes of a quoted key), "
            "percent-encoded. Anything that is not a valid key is answered 404."
        ),
    }


class KeyLookupSchema(AutoSchema):
    """The hand-written operations of the status-by-key views (they have no serializer)."""

    def __init__(self, responses: Any, summary: str) -> None:
        super().__init__()
        self._responses = responses
        self._summary = summary

    def _get_parameters(self) -> list[dict[str, Any]]:
        return [key_path_parameter()]

    # No serializer to guess: the answers are written out above. Without these two,
    # drf-spectacular guesses for the operation id and warns (drf_spectacular.W002).
    def get_request_serializer(self) -> None:
        return None

    def get_response_serializers(self) -> None:
        return None

    def _get_response_bodies(self, direction: str = "response") -> dict[str, Any]:
        return dict(self._responses(self.registry))

    def get_summary(self) -> str | None:
        return self._summary

    def get_tags(self) -> list[str]:
        return ["idempotency-keys"]


class KeyLookupViewExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Documents ``django_idempotency.urls``'s two views, and a project's subclasses of them."""

    target_class = "django_idempotency.drf.views._KeyAPIView"
    match_subclasses = True

    def view_replacement(self) -> type[APIView]:
        from django_idempotency.drf.views import KeyResponseView

        view_class: type[APIView] = self.target
        if view_class.schema is None:  # excluded from the schema by the project
            return view_class
        if issubclass(view_class, KeyResponseView):
            schema = KeyLookupSchema(key_response_responses, "The stored response of a key")
        else:
            schema = KeyLookupSchema(key_status_responses, "The status of an idempotency key")
        replacement: type[APIView] = type(
            view_class.__name__,
            (view_class,),
            {"schema": schema, "__module__": view_class.__module__},
        )
        return replacement
