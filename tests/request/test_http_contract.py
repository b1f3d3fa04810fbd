"""The HTTP contract through the DRF mixin: headers, problem+json errors, what is stored."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIRequestFactory

from django_idempotency import exceptions
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import lifecycle
from django_idempotency.request.fingerprint import request_fingerprint
from tests.support.factories import UserFactory, age_record, held_elsewhere
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/widget/"


def post(client, key, body=None, url=URL, method="post", **headers):
    if key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    call = getattr(client, method)
    return call(url, body if body is not None else {"name": "w"}, format="json", **headers)


def problem(response) -> dict:
    assert response["Content-Type"] == "application/problem+json", response.content
    return json.loads(response.content)


def test_first_execution_answers_with_the_view_and_replay_false(client, key):
    response = post(client, key)
    assert response.status_code == 201
    assert response["Idempotent-Replay"] == "false"
    assert response.cookies["session-ish"].value == "secret"
    assert response["X-Not-Stored"] == "1"


def test_replay_is_byte_for_byte_with_allowed_headers_only(client, key):
    first = post(client, key)
    replay = post(client, key)
    assert replay.status_code == first.status_code == 201
    assert replay.content == first.content
    assert replay["Idempotent-Replay"] == "true"
    for header in ("Content-Type", "Location", "X-Widget-Id"):
        assert replay[header] == first[header]
    assert not replay.has_header("X-Not-Stored")
    assert not replay.cookies
    assert Widget.objects.count() == 1


def test_retry_while_running_gets_409_with_retry_after(client, key, gate):
    started, release = gate("held")
    outcome = {}

    def first():
        outcome["first"] = post(client, key, {"name": "held"})
        connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(20)
    retry = post(client, key, {"name": "held"})
    release.set()
    thread.join(20)
    assert retry.status_code == 409
    assert 1 <= int(retry["Retry-After"]) <= 30
    body = problem(retry)
    assert body["error"] == "transaction_in_progress" and body["status"] == 409
    assert {"type", "title", "detail", "message"} <= body.keys()
    assert outcome["first"].status_code == 201
    assert post(client, key, {"name": "held"}).content == outcome["first"].content
    assert Widget.objects.count() == 1


@pytest.mark.parametrize(
    "second",
    [
        {"body": {"name": "other"}},
        {"url": "/api/other-widget/"},
        {"method": "patch"},
        {"url": URL + "?x=1"},
    ],
    ids=["body", "endpoint", "method", "query"],
)
def test_same_key_for_another_request_is_422(client, key, second):
    assert post(client, key).status_code == 201
    response = post(client, key, **second)
    assert response.status_code == 422
    assert problem(response)["error"] == "payload_mismatch"
    assert Widget.objects.count() == 1


def test_accept_is_negotiated_only_by_a_request_that_runs(client, key):
    """A replay sends the stored bytes whatever the retry accepts; a refusal falls back to
    the first renderer rather than a 406; a first request the view cannot answer in a type the
    client accepts gets DRF's 406 and leaves its key free."""
    refused = post(client, key, HTTP_ACCEPT="application/xml")
    assert refused.status_code == 406
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    first = post(client, key)
    assert first.status_code == 201
    replay = post(client, key, HTTP_ACCEPT="application/xml")
    assert replay.status_code == 201 and replay.content == first.content
    assert replay["Idempotent-Replay"] == "true"
    mismatch = post(client, key, body={"name": "other"}, HTTP_ACCEPT="application/xml")
    assert mismatch.status_code == 422
    assert problem(mismatch)["error"] == "payload_mismatch"
    browsable = post(client, key, body={"name": "other"}, HTTP_ACCEPT="text/html")
    assert browsable.status_code == 422
    assert browsable["Content-Type"].startswith("text/html")
    assert Widget.objects.count() == 1


def test_a_body_django_cannot_parse_is_its_400_not_a_500(key, settings):
    """Raised before DRF negotiated (the fingerprint reads the body first): DRF's handling of
    an uncaught error, which under DEBUG reads the negotiated renderer, still gets one."""
    settings.DEBUG = True
    response = Client(raise_request_exception=False).post(
        URL, b'{"name": "w"}', content_type="multipart/form-data", HTTP_IDEMPOTENCY_KEY=key
    )
    assert response.status_code == 400
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def test_reformatted_json_is_the_same_request(client, key):
    first = client.post(
        URL, '{"name": "w", "sleep": 0}', content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )  # fmt: skip
    second = client.post(
        URL, '{"sleep":0,\n "name":"w"}', content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )  # fmt: skip
    assert second["Idempotent-Replay"] == "true" and second.content == first.content


def test_missing_key_is_400_when_required(client):
    response = post(client, None)
    assert response.status_code == 400
    assert problem(response)["error"] == "idempotency_key_missing"
    assert not Widget.objects.exists()


def test_missing_key_runs_unguarded_when_optional(client, idempotency_settings):
    idempotency_settings(KEY_REQUIRED=False)
    assert post(client, None).status_code == 201
    assert post(client, None).status_code == 201
    assert Widget.objects.count() == 2
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize(
    "raw",
    ["", " ", "x" * 256, "caf\u00e9", "a\tb", "a,b", '"a", "b"', '"unterminated', "a\x7fb"],
    ids=["empty", "blank", "too-long", "non-ascii", "tab", "sent-twice", "two-quoted",
         "unterminated", "del"],
)  # fmt: skip
def test_invalid_keys_are_400(client, raw):
    response = post(client, raw)
    assert response.status_code == 400
    assert problem(response)["error"] == "idempotency_key_invalid"
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()


def test_quoted_and_bare_key_name_the_same_record(client):
    first = post(client, "abc-123")
    second = post(client, '"abc-123"')
    assert second["Idempotent-Replay"] == "true" and second.content == first.content
    assert IdempotencyRecord.objects.get().key == "abc-123"


def test_longest_valid_key_is_accepted(client):
    assert post(client, "k" * 255).status_code == 201


def test_view_exception_releases_the_key_for_an_immediate_retry(client, key):
    client.raise_request_exception = False
    failed = post(client, key, {"name": "w", "fail": True})
    assert failed.status_code == 500
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()
    assert post(client, key, {"name": "w", "fail": True}).status_code == 500
    assert post(client, key, {"name": "w2"}).status_code == 201  # released: a new body is fine


def test_server_error_response_rolls_back_and_is_not_stored(client, key):
    response = post(client, key, {"name": "w", "status": 500})
    assert response.status_code == 500
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()


def test_client_error_from_the_view_is_stored(client, key):
    first = post(client, key, {"name": "w", "status": 409})
    assert first.status_code == 409
    replay = post(client, key, {"name": "w", "status": 409})
    assert replay["Idempotent-Replay"] == "true" and replay.content == first.content


def test_validation_error_raised_by_the_view_is_not_stored(client, key):
    response = client.post("/api/widgets/", {"name": ""}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert response.status_code == 400
    assert not IdempotencyRecord.objects.exists()
    fixed = client.post("/api/widgets/", {"name": "ok"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert fixed.status_code == 201


def test_malformed_json_is_a_400_and_stores_nothing(client, key):
    response = client.post(
        URL, b'{"name": ', content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert response.status_code == 400
    assert not IdempotencyRecord.objects.exists()


def test_streaming_response_replay_says_the_body_was_not_retained(client, key):
    first = post(client, key, {"name": "w", "stream": True})
    assert first.status_code == 200
    assert b"".join(first.streaming_content).startswith(b"streamed")
    replay = post(client, key, {"name": "w", "stream": True})
    assert replay.status_code == 200 and replay["Idempotent-Replay"] == "true"
    assert problem(replay)["error"] == "response_not_retained"
    assert Widget.objects.count() == 1


def test_authentication_failure_is_never_stored(client, key):
    denied = client.post(
        "/api/auth-widget/", {"name": "w"}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert denied.status_code in (401, 403)
    assert not IdempotencyRecord.objects.exists()
    user = UserFactory()
    token = Token.objects.create(user=user)
    allowed = client.post(
        "/api/auth-widget/", {"name": "w"}, format="json", HTTP_IDEMPOTENCY_KEY=key,
        HTTP_AUTHORIZATION=f"Token {token.key}",
    )  # fmt: skip
    assert allowed.status_code == 201
    assert IdempotencyRecord.objects.get().scope == f"user:{user.pk}"


def test_throttled_request_is_never_stored(client, key):
    from django.core.cache import cache

    cache.clear()
    assert post(client, "first", url="/api/throttled-widget/").status_code == 201
    throttled = post(client, key, url="/api/throttled-widget/")
    assert throttled.status_code == 429
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def test_a_replay_is_not_throttled_but_a_new_request_is(client, key):
    """A replay is the caller's own stored answer: DRF's throttles and permissions are not run
    again for it, where a new key still meets them."""
    from django.core.cache import cache

    cache.clear()
    first = post(client, key, url="/api/throttled-widget/")
    assert first.status_code == 201
    replay = post(client, key, url="/api/throttled-widget/")
    assert replay.status_code == 201 and replay["Idempotent-Replay"] == "true"
    assert replay.content == first.content
    assert post(client, key + "-new", url="/api/throttled-widget/").status_code == 429


def test_a_replay_can_be_made_to_meet_the_checks_again(client, key, monkeypatch):
    from django.core.cache import cache

    from tests.testapp.views import ThrottledWidgetView

    monkeypatch.setattr(ThrottledWidgetView, "idempotency_recheck_replays", True, raising=False)
    cache.clear()
    assert post(client, key, url="/api/throttled-widget/").status_code == 201
    assert post(client, key, url="/api/throttled-widget/").status_code == 429


def test_a_claimed_key_refused_by_a_permission_is_given_back(client, key):
    from django_idempotency import signals

    released: list[str] = []
    receiver = lambda **kwargs: released.append(kwargs["reason"])  # noqa: E731
    signals.key_released.connect(receiver, weak=False)
    try:
        denied = post(client, key, url="/api/auth-widget/")
    finally:
        signals.key_released.disconnect(receiver)
    assert denied.status_code in (401, 403)
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert released == ["refused"]


def test_tenants_never_see_each_others_responses(client, key):
    alice, bob = UserFactory(), UserFactory()
    client.force_authenticate(alice)
    mine = post(client, key, {"name": "alice"})
    client.force_authenticate(bob)
    theirs = post(client, key, {"name": "alice"})
    assert theirs["Idempotent-Replay"] == "false"
    assert json.loads(theirs.content)["id"] != json.loads(mine.content)["id"]
    assert Widget.objects.count() == 2
    client.force_authenticate(alice)
    assert post(client, key, {"name": "alice"}).content == mine.content


def test_takeover_after_the_lease_runs_the_request_once_more(client, key):
    # A request still running somewhere else holds the key; then it dies, leaving a PROCESSING
    # record and no business row, and its lease runs out.
    request = APIRequestFactory().post(URL, {"name": "w"}, format="json")
    ident = lifecycle.identify(
        request, key, scope="anonymous", fingerprint=request_fingerprint(request)
    )
    with held_elsewhere(ident):
        assert post(client, key).status_code == 409
        age_record("anonymous", key, 31)
        response = post(client, key)
    assert response.status_code == 201
    assert json.loads(response.content)["attempt"] == 2
    assert Widget.objects.count() == 1


def test_ttl_expiry_lets_the_key_run_again(client, key):
    first = post(client, key)
    age_record("anonymous", key, (23 * 60 + 59) * 60)
    assert post(client, key).content == first.content
    age_record("anonymous", key, 2 * 60)
    again = post(client, key)
    assert again["Idempotent-Replay"] == "false"
    assert Widget.objects.count() == 2


def test_get_requests_are_not_guarded(client, key):
    post(client, key, url="/api/widgets/")
    assert client.get("/api/widgets/", HTTP_IDEMPOTENCY_KEY=key).status_code == 200
    assert IdempotencyRecord.objects.count() == 1


def _http_errors() -> list[type[exceptions.IdempotencyHTTPError]]:
    found: list[type[exceptions.IdempotencyHTTPError]] = []
    pending = [exceptions.IdempotencyHTTPError]
    while pending:
        for subclass in pending.pop().__subclasses__():
            pending.append(subclass)
            found.append(subclass)
    return found


@pytest.mark.parametrize("error", _http_errors(), ids=lambda error: error.__name__)
def test_message_says_what_to_do_and_does_not_repeat_detail(error: Any) -> None:
    """``detail`` explains; ``message`` is the short instruction, never the same text."""
    arguments = {"ResponseNotRetained": (200,), "TransactionInProgress": (3,)}
    body = error(*arguments.get(error.__name__, ())).problem("urn:x:")
    assert body["message"] != body["detail"]
    assert len(body["message"]) <= 60, body["message"]
    assert body["message"] not in body["detail"]
