"""The drf-spectacular extension documents idempotent operations, and only those."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from django.conf import settings
from django.test import override_settings
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.utils import OpenApiResponse, extend_schema
from hypothesis import given
from hypothesis import strategies as st
from rest_framework import mixins, viewsets
from rest_framework.decorators import api_view, schema
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter

from django_idempotency.drf import IdempotencyMixin
from django_idempotency.drf.openapi import (
    DRF_ERRORS_COMPONENT,
    KEY_PATTERN,
    PROBLEM_COMPONENT,
    IdempotentAutoSchema,
    IdempotentSchemaMixin,
)
from django_idempotency.exceptions import IdempotencyKeyInvalid
from django_idempotency.request.decorators import idempotent
from django_idempotency.request.keys import parse_key
from tests.testapp.models import Widget
from tests.testapp.views import WidgetSerializer, WidgetViewSet

PROBLEM = "application/problem+json"
JSON = "application/json"
SPECTACULAR = {
    **settings.REST_FRAMEWORK,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}


class PlainWidgetViewSet(viewsets.ModelViewSet[Widget]):
    queryset = Widget.objects.all()
    serializer_class = WidgetSerializer


# extend_schema builds on DEFAULT_SCHEMA_CLASS when it decorates, as a project using
# drf-spectacular has it set at import time; the test settings leave DRF's own default.
with override_settings(REST_FRAMEWORK=SPECTACULAR):

    class DocumentedWidgetViewSet(
        IdempotencyMixin, mixins.CreateModelMixin, viewsets.GenericViewSet[Widget]
    ):
        """Its own ``extend_schema`` on the action must survive, and still gain our answers."""

        queryset = Widget.objects.all()
        serializer_class = WidgetSerializer

        @extend_schema(
            responses={201: WidgetSerializer, 400: OpenApiResponse(description="Invalid widget.")}
        )
        def create(self, request: Any, *args: Any, **kwargs: Any) -> Response:
            return super().create(request, *args, **kwargs)

    class HiddenWidgetViewSet(
        IdempotencyMixin, mixins.CreateModelMixin, viewsets.GenericViewSet[Widget]
    ):
        queryset = Widget.objects.all()
        serializer_class = WidgetSerializer
        schema = None

    @extend_schema(request=WidgetSerializer, responses={201: WidgetSerializer})
    @api_view(["POST"])
    @schema(IdempotentAutoSchema(methods=["POST"]))
    @idempotent(methods=["POST"])
    def function_view(request: Any) -> Response:
        return Response({}, status=201)

    @extend_schema(request=WidgetSerializer, responses={201: WidgetSerializer})
    @api_view(["POST"])
    @idempotent
    def undocumented_function_view(request: Any) -> Response:
        return Response({}, status=201)


def generate() -> dict[str, Any]:
    router = SimpleRouter()
    router.register("widgets", WidgetViewSet)
    router.register("plain", PlainWidgetViewSet, basename="plain")
    router.register("documented", DocumentedWidgetViewSet, basename="documented")
    router.register("hidden", HiddenWidgetViewSet, basename="hidden")
    patterns = [
        *router.urls,
        path("function/", function_view),
        path("undocumented/", undocumented_function_view),
    ]
    with override_settings(REST_FRAMEWORK=SPECTACULAR):
        result: dict[str, Any] = SchemaGenerator(patterns=patterns).get_schema(
            request=None, public=True
        )
    return result


def header_names(operation: dict[str, Any]) -> list[str]:
    return [p["name"] for p in operation.get("parameters", []) if p["in"] == "header"]


def assert_documented(operation: dict[str, Any], success: str) -> None:
    key = next(p for p in operation["parameters"] if p["name"] == "Idempotency-Key")
    assert key["in"] == "header"
    assert key["required"] is True
    assert key["schema"] == {
        "type": "string",
        "minLength": 1,
        "maxLength": 257,
        "pattern": KEY_PATTERN,
    }
    responses = operation["responses"]
    assert "Idempotent-Replay" in responses[success]["headers"]
    for status in ("400", "409", "422", "503"):
        schema_ref = responses[status]["content"][PROBLEM]["schema"]
        assert schema_ref == {"$ref": f"#/components/schemas/{PROBLEM_COMPONENT}"}
    # A 400 is a key error (problem+json) or DRF's validation errors (plain JSON).
    assert responses["400"]["content"][JSON]["schema"] == {
        "$ref": f"#/components/schemas/{DRF_ERRORS_COMPONENT}"
    }
    assert set(responses["409"]["content"]) == {PROBLEM}
    assert "Retry-After" in responses["409"]["headers"]
    assert "Retry-After" in responses["503"]["headers"]
    assert "Retry-After" not in responses["422"].get("headers", {})


def test_mixin_views_document_the_key_and_the_answers() -> None:
    paths = generate()["paths"]
    assert_documented(paths["/widgets/"]["post"], "201")
    assert_documented(paths["/widgets/{id}/"]["patch"], "200")


def test_only_the_guarded_methods_are_documented() -> None:
    paths = generate()["paths"]
    assert header_names(paths["/widgets/"]["get"]) == []
    assert header_names(paths["/widgets/{id}/"]["put"]) == []  # the mixin guards POST and PATCH
    assert "409" not in paths["/widgets/{id}/"]["put"]["responses"]
    assert header_names(paths["/plain/"]["post"]) == []
    assert set(paths["/plain/"]["post"]["responses"]) == {"201"}


def test_problem_component_lists_every_error_code() -> None:
    problem = generate()["components"]["schemas"][PROBLEM_COMPONENT]
    assert problem["required"] == ["type", "title", "status", "detail", "error", "message"]
    description = problem["properties"]["error"]["description"]
    for code in (
        "idempotency_key_missing",
        "idempotency_key_invalid",
        "transaction_in_progress",
        "idempotency_lease_lost",
        "payload_mismatch",
        "idempotency_store_unavailable",
    ):
        assert code in description


def test_the_views_own_responses_are_kept_and_extended() -> None:
    operation = generate()["paths"]["/documented/"]["post"]
    assert operation["responses"]["400"]["description"] == "Invalid widget."
    assert_documented(operation, "201")
    # The view itself is left as it was: only the copy used for the schema was extended.
    assert not issubclass(
        DocumentedWidgetViewSet.create.kwargs["schema"],  # type: ignore[attr-defined]
        IdempotentSchemaMixin,
    )


def test_views_excluded_from_the_schema_stay_excluded() -> None:
    assert "/hidden/" not in generate()["paths"]


def test_function_views_are_documented_when_they_name_the_schema() -> None:
    paths = generate()["paths"]
    assert_documented(paths["/function/"]["post"], "201")
    assert header_names(paths["/undocumented/"]["post"]) == []


@pytest.mark.parametrize("required", [True, False])
def test_the_parameter_follows_the_settings(required: bool) -> None:
    with override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key", "KEY_REQUIRED": required}):
        operation = generate()["paths"]["/widgets/"]["post"]
    names = header_names(operation)
    assert names == ["X-Request-Key"]
    assert operation["parameters"][0]["required"] is required


def test_the_app_registers_the_extension_when_drf_spectacular_is_installed() -> None:
    # In a fresh interpreter, so that no import made by this test module can stand in for it.
    script = (
        "import sys, django; django.setup(); print('django_idempotency.drf.openapi' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.stdout.strip() == "True"


def validator(schema: dict[str, Any], component: str) -> Any:
    """A JSON Schema validator for one of the schema's components, its references resolved."""
    document = {"$ref": f"#/components/schemas/{component}", "components": schema["components"]}
    return jsonschema_rs.validator_for(document)


@pytest.mark.django_db(transaction=True)
def test_both_400_shapes_describe_what_the_api_answers(client: Any, key: str) -> None:
    schema = generate()
    described = schema["paths"]["/widgets/"]["post"]["responses"]["400"]["description"]
    assert "application/problem+json" in described
    assert "application/json" in described
    invalid = client.post(
        "/api/widgets/", {"name": ""}, format="json", headers={"Idempotency-Key": key}
    )
    assert invalid.status_code == 400
    assert invalid["Content-Type"] == JSON
    assert validator(schema, DRF_ERRORS_COMPONENT).is_valid(invalid.json())
    unparsable = client.post(
        "/api/widgets/", b"{", content_type=JSON, headers={"Idempotency-Key": key}
    )
    assert unparsable.status_code == 400
    assert validator(schema, DRF_ERRORS_COMPONENT).is_valid(unparsable.json())
    missing = client.post("/api/widgets/", {"name": "w"}, format="json")
    assert missing.status_code == 400
    assert missing["Content-Type"] == PROBLEM
    assert validator(schema, PROBLEM_COMPONENT).is_valid(missing.json())
    assert not validator(schema, PROBLEM_COMPONENT).is_valid(invalid.json())


@given(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300))
def test_the_key_pattern_accepts_what_the_server_accepts(value: str) -> None:
    try:
        parse_key(value)
        accepted = True
    except IdempotencyKeyInvalid:
        accepted = False
    # HTTP strips the whitespace around a header value before anyone sees it.
    value = value.strip(" \t")
    if "\\" in value and value.startswith('"'):
        return  # escapes inside quotes: accepted by the server, left out of the pattern
    assert bool(re.fullmatch(KEY_PATTERN, value)) == accepted


@given(st.from_regex(KEY_PATTERN, fullmatch=True))
def test_every_key_the_pattern_allows_is_accepted(value: str) -> None:
    assert 1 <= len(parse_key(value)) <= 255
