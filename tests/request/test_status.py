"""Status and result by key (``django_idempotency.urls``): the caller's own key only, resolved
as the writes resolved it; everything else the same 404."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
from django.db import connection
from django.test import override_settings
from django.urls import include, path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.generators import SchemaGenerator
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency.conf import conf
from django_idempotency.drf.openapi import KEY_STATUS_COMPONENT, PROBLEM_COMPONENT
from django_idempotency.drf.views import KeyStatusView
from django_idempotency.exceptions import IdempotencyKeyNotFound
from django_idempotency.models import IdempotencyRecord
from tests.request.test_drf_openapi import SPECTACULAR
from tests.support.factories import UserFactory

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.support.status_urls"),
]

PROBLEM = "application/problem+json"


def status_url(key: str, prefix: str = "keys") -> str:
    return f"/{prefix}/idempotency-keys/{quote(key, safe='')}"


def post(
    client: APIClient,
    key: str,
    path: str = "/api/widget/",
    headers: dict[str, str] | None = None,
    **body: Any,
) -> Any:
    return client.post(
        path, {"name": "w", **body}, format="json", HTTP_IDEMPOTENCY_KEY=key, **(headers or {})
    )


def assert_not_found(response: Any) -> bytes:
    assert response.status_code == 404
    assert response["Content-Type"] == PROBLEM
    assert response["Cache-Control"] == "no-store"
    assert json.loads(response.content)["error"] == "idempotency_key_not_found"
    content: bytes = response.content
    return content


@pytest.fixture
def user_client() -> APIClient:
    client = APIClient()
    client.force_login(UserFactory())
    return client


def test_a_completed_key_reports_its_status_and_links_its_response(user_client, key):
    first = post(user_client, key)
    assert first.status_code == 201

    status = user_client.get(status_url(key))
    assert status.status_code == 200
    assert status["Cache-Control"] == "no-store"
    body = status.json()
    assert body["key"] == key
    assert body["status"] == "completed"
    assert body["response_status"] == 201
    record = IdempotencyRecord.objects.get(key=key)
    assert parse_datetime(body["created"]) == record.created_at
    assert parse_datetime(body["expires"]) == record.expires_at
    link = f"/keys/idempotency-keys/{key}/response"
    assert status["Link"] == f'<{link}>; rel="response"'
    assert reverse("idempotency-key-response", kwargs={"key": key}) == link

    stored = user_client.get(link)
    assert stored.status_code == 201
    assert stored.content == first.content  # byte for byte
    assert stored["Content-Type"] == first["Content-Type"]
    assert stored["Location"] == first["Location"]
    assert stored["Idempotent-Replay"] == "true"
    assert stored["Cache-Control"] == "no-store"
    assert "Set-Cookie" not in stored  # what a replay never carries


def test_a_key_in_progress_is_processing_and_its_response_not_there_yet(user_client, key, gate):
    started, release = gate("held")
    answers: list[Any] = []

    def first() -> None:
        try:
            answers.append(post(user_client, key, name="held"))
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(30)
        status = user_client.get(status_url(key))
        assert status.status_code == 200
        assert status.json()["status"] == "processing"
        assert status.json()["response_status"] is None
        assert "Link" not in status
        early = user_client.get(status_url(key) + "/response")
        assert early.status_code == 409
        assert early.json()["error"] == "transaction_in_progress"
        assert int(early["Retry-After"]) >= 1
    finally:
        release.set()
        thread.join(60)
    assert answers[0].status_code == 201
    assert user_client.get(status_url(key)).json()["status"] == "completed"
    assert user_client.get(status_url(key) + "/response").content == answers[0].content


def test_everything_but_the_callers_live_key_is_the_same_404(user_client, key):
    assert post(user_client, key).status_code == 201
    bodies = {
        "unknown": assert_not_found(user_client.get(status_url(f"other-{key}"))),
        "unknown response": assert_not_found(user_client.get(status_url("nope") + "/response")),
        "too long": assert_not_found(user_client.get(status_url("x" * 300))),
        "not ascii": assert_not_found(user_client.get(status_url("kéy"))),
        "space around": assert_not_found(user_client.get(status_url(" k"))),
    }
    other = APIClient()
    other.force_login(UserFactory())
    bodies["another user's"] = assert_not_found(other.get(status_url(key)))
    bodies["another user's response"] = assert_not_found(other.get(status_url(key) + "/response"))
    bodies["anonymous"] = assert_not_found(APIClient().get(status_url(key)))
    assert len(set(bodies.values())) == 1, bodies  # never a hint that the key exists elsewhere
    # The owner still sees it.
    assert user_client.get(status_url(key)).status_code == 200


def test_a_released_key_is_404(user_client, key):
    failed = post(user_client, key, status=500)  # not stored: the key is released
    assert failed.status_code == 500
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert_not_found(user_client.get(status_url(key)))


def test_an_expired_key_is_404_before_any_sweep(user_client, key):
    assert post(user_client, key).status_code == 201
    IdempotencyRecord.objects.filter(key=key).update(
        expires_at=timezone.now() - timedelta(seconds=5)
    )
    assert_not_found(user_client.get(status_url(key)))
    assert_not_found(user_client.get(status_url(key) + "/response"))


def test_a_quoted_key_is_looked_up_by_its_characters(user_client):
    key = f"a key {uuid.uuid4()}"
    assert post(user_client, f'"{key}"').status_code == 201
    assert user_client.get(status_url(key)).json()["key"] == key


def test_a_key_with_a_slash_or_ending_in_response_still_resolves(user_client):
    key = f"orders/{uuid.uuid4()}"
    first = post(user_client, key)
    status = user_client.get(status_url(key).replace("%2F", "/"))
    assert status.json()["key"] == key
    assert user_client.get(status_url(key) + "/response").content == first.content


def test_drf_token_clients_see_their_own_keys_only(key):
    owner, stranger = UserFactory(), UserFactory()
    token = f"Token {Token.objects.create(user=owner).key}"
    client = APIClient()
    assert post(client, key, headers={"HTTP_AUTHORIZATION": token}).status_code == 201
    # The mixin scoped the write by the user DRF authenticated; so is the lookup.
    assert client.get(status_url(key), HTTP_AUTHORIZATION=token).status_code == 200
    session = APIClient()
    session.force_login(owner)
    assert session.get(status_url(key)).status_code == 200  # the same user, another way in
    stranger_token = f"Token {Token.objects.create(user=stranger).key}"
    assert_not_found(client.get(status_url(key), HTTP_AUTHORIZATION=stranger_token))
    assert_not_found(client.get(status_url(key)))
    # Credentials DRF refuses are not a 401 that says the key matters: the same 404.
    assert_not_found(client.get(status_url(key), HTTP_AUTHORIZATION="Token not-a-token"))


def test_credential_scoped_clients_behind_the_middleware(key):
    """A bearer token only the view checks: the middleware scoped the write by its digest."""
    client = APIClient()
    bearer = "Bearer client-one-secret"
    first = client.post(
        "/plain/middleware/", {"name": "w"}, format="json",
        HTTP_IDEMPOTENCY_KEY=key, HTTP_AUTHORIZATION=bearer,
    )  # fmt: skip
    assert first.status_code == 201
    for prefix in ("keys", "plain-keys"):
        status = client.get(status_url(key, prefix), HTTP_AUTHORIZATION=bearer)
        assert status.status_code == 200, prefix
        stored = client.get(status_url(key, prefix) + "/response", HTTP_AUTHORIZATION=bearer)
        assert stored.content == first.content
        other = "Bearer client-two-secret"
        assert_not_found(client.get(status_url(key, prefix), HTTP_AUTHORIZATION=other))
        assert_not_found(client.get(status_url(key, prefix)))


def test_a_drf_token_client_finds_the_keys_it_wrote_through_the_middleware(key):
    """The middleware runs before DRF authenticates, so it scoped the write by the token's
    digest; the DRF status view, which knows the token's user, still finds it, and the
    writes the client made through the mixin too."""
    owner, stranger = UserFactory(), UserFactory()
    token = f"Token {Token.objects.create(user=owner).key}"
    client = APIClient()
    first = client.post(
        "/doors/middleware/drf/", {"name": "w"}, format="json",
        HTTP_IDEMPOTENCY_KEY=key, HTTP_AUTHORIZATION=token,
    )  # fmt: skip
    assert first.status_code == 201
    status = client.get(status_url(key), HTTP_AUTHORIZATION=token)
    assert status.status_code == 200 and status.json()["status"] == "completed"
    stored = client.get(status_url(key) + "/response", HTTP_AUTHORIZATION=token)
    assert stored.content == first.content
    mixin_key = f"{key}-mixin"
    assert post(client, mixin_key, headers={"HTTP_AUTHORIZATION": token}).status_code == 201
    assert client.get(status_url(mixin_key), HTTP_AUTHORIZATION=token).status_code == 200
    stranger_token = f"Token {Token.objects.create(user=stranger).key}"
    assert_not_found(client.get(status_url(key), HTTP_AUTHORIZATION=stranger_token))
    assert_not_found(client.get(status_url(key)))


def test_with_credential_scope_refuse_a_lookup_with_unscoped_credentials_is_404(key):
    with override_settings(IDEMPOTENCY={"CREDENTIAL_SCOPE": "refuse"}):
        assert_not_found(APIClient().get(status_url(key), HTTP_AUTHORIZATION="Bearer x"))


def test_the_plain_django_views_scope_by_the_django_user(user_client, key):
    first = post(user_client, key, path="/plain/function/")
    assert first.status_code == 201
    status = user_client.get(status_url(key, "plain-keys"))
    assert status.json()["status"] == "completed"
    link = f"/plain-keys/idempotency-keys/{key}/response"
    assert status["Link"] == f'<{link}>; rel="response"'
    assert user_client.get(link).content == first.content
    assert_not_found(APIClient().get(status_url(key, "plain-keys")))


def test_the_anonymous_scope_is_a_scope_like_any_other(key):
    """Anonymous clients share one scope (``ANONYMOUS_SCOPE``): the key is their only secret."""
    client = APIClient()
    assert post(client, key).status_code == 201
    assert APIClient().get(status_url(key)).status_code == 200
    logged_in = APIClient()
    logged_in.force_login(UserFactory())
    assert_not_found(logged_in.get(status_url(key)))


def test_any_accept_header_gets_the_answer(user_client, key):
    post(user_client, key)
    status = user_client.get(status_url(key), HTTP_ACCEPT="application/xml")
    assert status.status_code == 200
    assert status["Content-Type"] == "application/json"


def test_the_schema_is_generated_without_warnings() -> None:
    """No ``unable to guess serializer`` (drf_spectacular.W002 in ``check --deploy``)."""
    from drf_spectacular.drainage import GENERATOR_STATS

    GENERATOR_STATS.reset()
    with override_settings(REST_FRAMEWORK=SPECTACULAR):
        SchemaGenerator(patterns=[path("api/v1/", include("django_idempotency.urls"))]).get_schema(
            request=None, public=True
        )
    assert not GENERATOR_STATS, (dict(GENERATOR_STATS._error_cache), GENERATOR_STATS._warn_cache)


def test_the_schema_documents_both_operations() -> None:
    with override_settings(REST_FRAMEWORK=SPECTACULAR):
        schema = SchemaGenerator(
            patterns=[path("api/v1/", include("django_idempotency.urls"))]
        ).get_schema(request=None, public=True)
    paths = schema["paths"]
    status = paths["/api/v1/idempotency-keys/{key}"]["get"]
    assert [p["name"] for p in status["parameters"]] == ["key"]
    assert set(status["responses"]) == {"200", "404", "503"}
    assert status["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": f"#/components/schemas/{KEY_STATUS_COMPONENT}"
    }
    assert "Link" in status["responses"]["200"]["headers"]
    assert status["responses"]["404"]["content"][PROBLEM]["schema"] == {
        "$ref": f"#/components/schemas/{PROBLEM_COMPONENT}"
    }
    stored = paths["/api/v1/idempotency-keys/{key}/response"]["get"]
    assert set(stored["responses"]) == {"200", "404", "409", "503", "default"}
    assert "Retry-After" in stored["responses"]["409"]["headers"]
    components = schema["components"]["schemas"]
    assert components[KEY_STATUS_COMPONENT]["required"] == [
        "key", "status", "response_status", "created", "expires",
    ]  # fmt: skip


@pytest.mark.parametrize("raw", ["%0A", "a%0Ab", "%00", "%F2%AE%83%A4", "a%0A/response"])
def test_characters_no_key_has_are_the_views_404_not_djangos(user_client, raw):
    assert_not_found(user_client.get(f"/keys/idempotency-keys/{raw}"))
    assert_not_found(user_client.get(f"/keys/idempotency-keys/{raw}/response"))


class NoAnonymousLookups(KeyStatusView):
    """The how-to's example: anonymous callers find nothing."""

    def get_idempotency_scope(self, request: Any) -> str:
        scope = super().get_idempotency_scope(request)
        if scope == conf.ANONYMOUS_SCOPE:
            raise IdempotencyKeyNotFound()
        return scope


def test_a_subclass_can_refuse_anonymous_lookups(key, rf):
    assert post(APIClient(), key).status_code == 201
    view = NoAnonymousLookups.as_view()
    assert_not_found(view(rf.get("/"), key=key))
    assert KeyStatusView.as_view()(rf.get("/"), key=key).status_code == 200


def test_without_drf_the_urls_mount_the_plain_views(monkeypatch):
    import importlib
    import importlib.util

    from django_idempotency import urls
    from django_idempotency.request import status as views

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "rest_framework" else real(name, *args),
    )
    try:
        importlib.reload(urls)
        assert urls._views is views
        assert urls.urlpatterns[1].callback.view_class is views.KeyStatusView
    finally:
        monkeypatch.undo()
        importlib.reload(urls)
    assert urls.urlpatterns[1].callback.view_class is KeyStatusView
