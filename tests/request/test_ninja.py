"""The Django Ninja door: the conformance every door meets (replay, 409 with Retry-After, 422,
the same problem+json bodies), sync and async, scoped by Ninja's auth, and documented in Ninja's
OpenAPI schema; against the real database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient, Client, RequestFactory
from ninja import NinjaAPI

from django_idempotency.core.types import Identity, Proceed
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.models import IdempotencyRecord
from django_idempotency.ninja import idempotent, ninja_scope
from django_idempotency.request.fingerprint import request_fingerprint
from tests.support.factories import UserFactory, held_elsewhere
from tests.testapp.models import Widget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.support.ninja_urls")]

PROBLEM = "application/problem+json"
SYNC, ASYNC = "/ninja/widgets", "/ninja/async-widgets"


def post(path: str, body: dict[str, Any], key: str | None = None, **headers: str) -> Any:
    """POST through Django's WSGI handler (sync operations) or its ASGI one (async ones)."""
    if key is not None:
        headers["Idempotency-Key"] = key
    if path == ASYNC or path.startswith("/ninja/partner"):
        client = AsyncClient(raise_request_exception=False)
        return async_to_sync(client.post)(
            path, json.dumps(body), content_type="application/json", headers=headers
        )
    return Client(raise_request_exception=False).post(
        path, json.dumps(body), content_type="application/json", headers=headers
    )


@pytest.fixture
def key() -> str:
    return f"ninja-{uuid.uuid4()}"


def record_of(key: str) -> IdempotencyRecord | None:
    return IdempotencyRecord.objects.filter(key=key).first()


@pytest.mark.parametrize("path", [SYNC, ASYNC])
def test_a_retry_replays_the_first_response_and_runs_nothing(path: str, key: str):
    first = post(path, {"name": "a"}, key)
    assert first.status_code == 201 and first["Idempotent-Replay"] == "false"
    assert first.json()["name"] == "a"
    replay = post(path, {"name": "a"}, key)
    assert replay.status_code == 201 and replay["Idempotent-Replay"] == "true"
    assert replay.content == first.content
    assert replay["Content-Type"] == first["Content-Type"]
    assert Widget.objects.count() == 1


@pytest.mark.parametrize("path", [SYNC, ASYNC])
def test_the_key_used_for_another_request_is_a_422_problem(path: str, key: str):
    assert post(path, {"name": "a"}, key).status_code == 201
    mismatch = post(path, {"name": "b"}, key)
    assert mismatch.status_code == 422 and mismatch["Content-Type"] == PROBLEM
    body = mismatch.json()
    assert body["error"] == "payload_mismatch" and body["status"] == 422
    assert body["type"].endswith("payload_mismatch") and body["message"]
    assert list(Widget.objects.values_list("name", flat=True)) == ["a"]


@pytest.mark.parametrize("path", [SYNC, ASYNC])
def test_a_key_held_by_a_request_in_flight_is_a_409_with_retry_after(path: str, key: str):
    body = json.dumps({"name": "a"})
    request = RequestFactory().post(path, body, "application/json")
    ident = Identity("anonymous", key, request_fingerprint(request), "POST", path)
    with held_elsewhere(ident) as held:
        assert isinstance(held, Proceed)
        conflict = post(path, {"name": "a"}, key)
    assert conflict.status_code == 409 and conflict["Content-Type"] == PROBLEM
    assert conflict.json()["error"] == "transaction_in_progress"
    assert 1 <= int(conflict["Retry-After"]) <= 30
    assert not Widget.objects.exists()


@pytest.mark.parametrize("path", [SYNC, ASYNC])
def test_a_missing_or_malformed_key_is_a_400_problem(path: str):
    missing = post(path, {"name": "a"})
    assert missing.status_code == 400 and missing.json()["error"] == "idempotency_key_missing"
    invalid = post(path, {"name": "a"}, "two words")
    assert invalid.status_code == 400 and invalid.json()["error"] == "idempotency_key_invalid"
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("path", [SYNC, ASYNC])
def test_an_error_rolls_back_releases_the_key_and_the_retry_runs(path: str, key: str):
    failed = post(path, {"name": "a", "fail": True}, key)
    assert failed.status_code == 503 and failed.json() == {"detail": "the widget service is down"}
    assert not Widget.objects.exists() and record_of(key) is None
    assert post(path, {"name": "a"}, key).status_code == 201  # another body: the key was freed
    assert Widget.objects.count() == 1


def test_ninjas_own_validation_claims_no_key(key: str):
    invalid = post(SYNC, {"nom": "a"}, key)
    assert invalid.status_code == 422 and invalid["Content-Type"].startswith("application/json")
    assert "detail" in invalid.json() and record_of(key) is None


def test_keys_are_scoped_by_ninjas_authenticated_user(key: str):
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    path = "/ninja/my-widgets"
    answers = [
        post(path, {"name": "w"}, key, Authorization=f"Bearer {user.username}")
        for user in (alice, bob, alice)
    ]
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert [a["Idempotent-Replay"] for a in answers] == ["false", "false", "true"]
    assert sorted(Widget.objects.values_list("created_by", flat=True)) == ["alice", "bob"]
    scopes = set(IdempotencyRecord.objects.values_list("scope", flat=True))
    assert scopes == {f"user:{alice.pk}", f"user:{bob.pk}"}
    refused = post(path, {"name": "w"}, f"{key}-x")
    assert refused.status_code == 401 and record_of(f"{key}-x") is None


def test_keys_are_scoped_by_a_digest_of_ninjas_token_never_the_token(key: str):
    path = "/ninja/partner-widgets"
    first = post(path, {"name": "w"}, key, **{"X-API-Key": "pk_first"})
    second = post(path, {"name": "w"}, key, **{"X-API-Key": "pk_second"})
    again = post(path, {"name": "w"}, key, **{"X-API-Key": "pk_first"})
    assert [r.status_code for r in (first, second, again)] == [201, 201, 201]
    assert again["Idempotent-Replay"] == "true" and second["Idempotent-Replay"] == "false"
    assert Widget.objects.count() == 2
    scopes = list(IdempotencyRecord.objects.values_list("scope", flat=True))
    assert len(set(scopes)) == 2
    assert all(s.startswith("ninja-token:") and "pk_" not in s for s in scopes)


def test_a_patch_keeps_the_headers_set_on_ninjas_response_parameter(key: str):
    widget = Widget.objects.create(name="old")
    path = f"/ninja/widgets/{widget.pk}"
    client = Client()

    def patch() -> Any:
        return client.patch(
            path, json.dumps({"name": "new"}), content_type="application/json",
            headers={"Idempotency-Key": key},
        )  # fmt: skip

    first, replay = patch(), patch()
    assert first.status_code == 200 and first["X-Widget-Id"] == str(widget.pk)
    assert replay["Idempotent-Replay"] == "true" and replay["X-Widget-Id"] == str(widget.pk)
    assert replay.content == first.content


def test_an_operation_of_a_mounted_router_is_guarded(key: str):
    answers = [post("/ninja/routed/widgets", {"name": "r"}, key) for _ in range(2)]
    assert [a["Idempotent-Replay"] for a in answers] == ["false", "true"]
    assert list(Widget.objects.values_list("created_by", flat=True)) == ["router"]


# --- OpenAPI ----------------------------------------------------------------------------------


def test_ninjas_openapi_documents_the_key_and_the_answers():
    from tests.testapp.ninja_api import api

    schema = api.get_openapi_schema()
    schema = json.loads(json.dumps(schema))  # as served: status codes are strings
    for path in ("/ninja/widgets", "/ninja/async-widgets", "/ninja/routed/widgets"):
        operation = schema["paths"][path]["post"]
        (header,) = [p for p in operation["parameters"] if p["in"] == "header"]
        assert header["name"] == "Idempotency-Key" and header["required"] is True
        responses = operation["responses"]
        assert "Idempotent-Replay" in responses["201"]["headers"]
        assert "$ref" in json.dumps(responses["201"]["content"])  # Ninja's own schema kept
        for status in ("400", "409", "422", "503"):
            problem = responses[status]["content"]["application/problem+json"]["schema"]
            assert problem["required"] == ["type", "title", "status", "detail", "error", "message"]
        assert "Retry-After" in responses["409"]["headers"]
        assert "Retry-After" in responses["503"]["headers"]
        assert "payload_mismatch" in json.dumps(responses["422"])
    patch = schema["paths"]["/ninja/widgets/{widget_id}"]["patch"]
    assert {p["name"] for p in patch["parameters"]} == {"widget_id", "Idempotency-Key"}


# --- misuse and scopes ---------------------------------------------------------------------------


def test_the_decorator_above_ninjas_says_where_it_goes():
    api = NinjaAPI(urls_namespace="misplaced")
    with pytest.raises(IdempotencyConfigurationError, match="below"):

        @idempotent
        @api.post("/x")
        def misplaced(request: Any) -> None: ...


def test_an_auth_that_does_not_tell_callers_apart_needs_a_scope():
    request = RequestFactory().post("/x")
    request.auth = True  # type: ignore[attr-defined]
    with pytest.raises(IdempotencyConfigurationError, match="scope="):
        ninja_scope(request)
    request.auth = None  # type: ignore[attr-defined]
    assert ninja_scope(request) == "anonymous"
    request.auth = UserFactory()  # type: ignore[attr-defined]
    assert ninja_scope(request) == f"user:{request.auth.pk}"  # type: ignore[attr-defined]


def test_nothing_else_in_the_package_imports_ninja():
    script = (
        "import sys, django; django.setup()\n"
        "import django_idempotency.request.middleware, django_idempotency.drf, "
        "django_idempotency.inbox, django_idempotency.outbox, django_idempotency.admin, "
        "django_idempotency.checks\n"
        "print('ninja' in sys.modules, 'django_idempotency.ninja' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.stdout.strip() == "False False"


@pytest.fixture
def atomic_requests() -> Any:
    """ATOMIC_REQUESTS on the business database, as a project would set it."""
    from django.db import connections

    settings_dict = connections["default"].settings_dict
    saved = settings_dict["ATOMIC_REQUESTS"]
    settings_dict["ATOMIC_REQUESTS"] = True
    yield
    settings_dict["ATOMIC_REQUESTS"] = saved


@pytest.mark.usefixtures("atomic_requests")
def test_under_atomic_requests_a_retry_still_replays_and_an_error_still_rolls_back(key: str):
    assert post(SYNC, {"name": "a", "fail": True}, key).status_code == 503
    assert not Widget.objects.exists() and record_of(key) is None
    first, replay = post(SYNC, {"name": "a"}, key), post(SYNC, {"name": "a"}, key)
    assert (first.status_code, replay["Idempotent-Replay"]) == (201, "true")
    assert replay.content == first.content and Widget.objects.count() == 1
