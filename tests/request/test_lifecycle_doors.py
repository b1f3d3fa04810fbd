"""Every guarantee on every entry point: the middleware (a plain view, an async view and a DRF
view without the mixin), ``@idempotent`` (sync and async), ``@idempotent`` below ``@api_view``,
and the DRF mixin. The views are in ``tests/testapp/doors.py``; each test runs once per door.

Async doors run through Django's test client here (the handler adapts them as ASGI would);
``tests/request/test_lifecycle_asgi.py`` drives them under a real ASGI server.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from django.test import Client, RequestFactory, override_settings
from rest_framework.authtoken.models import Token

from django_idempotency.core.types import Identity, Proceed
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request.fingerprint import request_fingerprint
from tests.support.factories import UserFactory, held_elsewhere
from tests.testapp import doors
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

SYNC = ["middleware", "middleware-drf", "decorator", "api-function", "mixin"]
ASYNC = ["middleware-async", "decorator-async"]
ALL = SYNC + ASYNC


@pytest.fixture
def http() -> Client:
    """A client that shows a 500 as the response a real client would get."""
    return Client(raise_request_exception=False)


def send(client: Client, door: str, key: str | None = None, **body: Any) -> Any:
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    extra = {name: body.pop(name) for name in list(body) if name.startswith("HTTP_")}
    return client.post(
        doors.DOORS[door], json.dumps(body), content_type="application/json", **headers, **extra
    )


def record_of(key: str, using: str = "default") -> IdempotencyRecord | None:
    return IdempotencyRecord.objects.using(using).filter(key=key).first()


@pytest.fixture
def atomic_requests() -> Iterator[None]:
    """ATOMIC_REQUESTS on the business database, as a project would set it."""
    settings_dict = connections["default"].settings_dict
    saved = settings_dict["ATOMIC_REQUESTS"]
    settings_dict["ATOMIC_REQUESTS"] = True
    yield
    settings_dict["ATOMIC_REQUESTS"] = saved


@pytest.fixture
def key_optional(idempotency_settings: Any) -> None:
    idempotency_settings(KEY_REQUIRED=False)


# --- 1. requests the library does not handle are served as Django would --------------------------


@pytest.mark.parametrize("door", SYNC)
def test_unkeyed_request_keeps_atomic_requests(http, door, atomic_requests, key_optional):
    response = send(http, door, mode="raise")
    assert response.status_code == 500
    assert not Widget.objects.exists(), "the view's write outlived its exception"


@pytest.mark.parametrize("door", SYNC)
def test_unguarded_method_keeps_atomic_requests(http, door, atomic_requests):
    # PUT is not guarded by default; ATOMIC_REQUESTS still wraps it (405 where not allowed).
    response = http.put(doors.DOORS[door], json.dumps({"mode": "raise"}), "application/json")
    assert response.status_code in (405, 500)
    assert not Widget.objects.exists()


@pytest.mark.django_db(transaction=True, databases=["default", "records"])
@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
@pytest.mark.parametrize("door", SYNC)
def test_records_in_another_database_keep_the_views_transaction(
    http, door, keyed, atomic_requests, key_optional
):
    with override_settings(DATABASE_ROUTERS=["tests.support.routers.RecordsElsewhere"]):
        key = f"k-{uuid.uuid4()}" if keyed else None
        response = send(http, door, key, mode="raise")
        assert response.status_code == 500
        assert not Widget.objects.exists(), "the business write outlived the exception"
        if keyed:
            assert record_of(key, "records") is None  # released, in the records' database
            assert send(http, door, key).status_code == 201
            assert record_of(key, "records").status == "COMPLETED"
            assert not IdempotencyRecord.objects.using("default").exists()
            assert Widget.objects.count() == 1


# --- 2. a view that rolls its own transaction back gets its own answer ---------------------------


@pytest.mark.parametrize("mode", ["rollback", "integrity"])
@pytest.mark.parametrize("door", ALL)
def test_a_view_that_rolls_back_gets_its_answer_and_a_retry_runs_again(http, door, mode, key):
    first = send(http, door, key, mode=f"{mode}_once")
    assert first.status_code == 409, first.content
    assert first.json()["error"] == ("declined" if mode == "rollback" else "duplicate")
    assert first["Idempotent-Replay"] == "false"
    assert not Widget.objects.exists(), "a write of the rolled-back view was kept"
    assert record_of(key) is None, "the key was left in flight"
    retry = send(http, door, key, mode=f"{mode}_once")
    assert retry.status_code == 201, retry.content
    assert retry.json()["calls"] == 2  # the view ran again: nothing had been committed
    assert Widget.objects.count() == 1


@pytest.mark.parametrize("door", SYNC)
def test_rolled_back_view_under_atomic_requests(http, door, key, atomic_requests):
    first = send(http, door, key, mode="rollback_once")
    assert first.status_code == 409
    assert not Widget.objects.exists()
    assert record_of(key) is None
    assert send(http, door, key, mode="rollback_once").status_code == 201


@pytest.mark.django_db(transaction=True, databases=["default", "records"])
@pytest.mark.parametrize("door", SYNC)
def test_a_rollback_of_the_views_database_stores_nothing_in_the_records_one(
    http, door, key, atomic_requests
):
    # The view marks its own database's transaction for rollback, not the records': the
    # answer must not be stored beside writes that never commit.
    with override_settings(DATABASE_ROUTERS=["tests.support.routers.RecordsElsewhere"]):
        first = send(http, door, key, mode="rollback_once")
        assert first.status_code == 409, first.content
        assert not Widget.objects.exists()
        assert record_of(key, "records") is None, "an answer was stored for rolled-back writes"
        retry = send(http, door, key, mode="rollback_once")
        assert retry.status_code == 201, retry.content
        assert retry.json()["calls"] == 2
        assert record_of(key, "records").status == "COMPLETED"


# --- the stored-response rule: exceptions store nothing, on every door ---------------------------


@pytest.mark.parametrize("door", ["middleware-drf", "api-function", "mixin"])
def test_validation_errors_store_nothing_and_release_the_key(http, door, key):
    refused = send(http, door, key, mode="validate")
    assert refused.status_code == 400
    assert refused.json() == {"name": ["not this one"]}
    assert record_of(key) is None
    assert not Widget.objects.exists()
    retry = send(http, door, key, mode="validate")
    assert retry.status_code == 400 and retry.get("Idempotent-Replay") != "true"


@pytest.mark.parametrize("door", ["middleware", "decorator", "middleware-async"])
def test_a_400_the_view_returns_is_its_final_answer(http, door, key):
    first = send(http, door, key, mode="validate")
    assert first.status_code == 400
    replay = send(http, door, key, mode="validate")
    assert replay["Idempotent-Replay"] == "true" and replay.content == first.content
    assert Widget.objects.count() == 1


@pytest.mark.parametrize("door", ALL)
def test_an_exception_releases_the_key_and_rolls_back(http, door, key):
    assert send(http, door, key, mode="raise_once").status_code == 500
    assert not Widget.objects.exists()
    assert record_of(key) is None
    assert send(http, door, key, mode="raise_once").status_code == 201


# --- 3. async doors: the whole state machine ------------------------------------------------------


@pytest.mark.parametrize("door", ALL)
def test_replay_conflict_and_mismatch(http, door, key):
    first = send(http, door, key, name="a")
    assert first.status_code == 201, first.content
    assert first["Idempotent-Replay"] == "false"
    replay = send(http, door, key, name="a")
    assert replay.status_code == 201
    assert replay["Idempotent-Replay"] == "true"
    assert replay.content == first.content
    mismatch = send(http, door, key, name="b")
    assert mismatch.status_code == 422
    assert mismatch.json()["error"] == "payload_mismatch"
    assert Widget.objects.count() == 1
    assert doors.calls[key] == 1


@pytest.mark.parametrize("door", ALL)
def test_a_key_held_by_another_request_is_a_409(http, door, key):
    # Another request holds the key (claimed, still running) for the same request as ours.
    request = RequestFactory().post(doors.DOORS[door], json.dumps({}), "application/json")
    ident = Identity("anonymous", key, request_fingerprint(request), "POST", doors.DOORS[door])
    with held_elsewhere(ident) as held:
        assert isinstance(held, Proceed)
        conflict = send(http, door, key)
    assert conflict.status_code == 409
    assert conflict.json()["error"] == "transaction_in_progress"
    assert 1 <= int(conflict["Retry-After"]) <= 30
    assert not Widget.objects.exists()


# --- 7. no replay ever crosses clients ------------------------------------------------------------


@pytest.fixture
def token_users() -> list[str]:
    return [f"Token {Token.objects.create(user=UserFactory()).key}" for _ in range(2)]


@pytest.mark.parametrize("door", ALL)
def test_two_token_clients_never_share_a_key(http, door, key, token_users):
    alice, bob = token_users
    mine = send(http, door, key, name="same", HTTP_AUTHORIZATION=alice)
    theirs = send(http, door, key, name="same", HTTP_AUTHORIZATION=bob)
    assert mine.status_code == theirs.status_code == 201, (mine.content, theirs.content)
    assert theirs["Idempotent-Replay"] == "false", "bob received alice's stored response"
    assert theirs.json()["id"] != mine.json()["id"]
    again = send(http, door, key, name="same", HTTP_AUTHORIZATION=alice)
    assert again["Idempotent-Replay"] == "true" and again.content == mine.content
    scopes = set(IdempotencyRecord.objects.filter(key=key).values_list("scope", flat=True))
    assert len(scopes) == 2
    for scope in scopes:  # a digest or a user id, never the credentials themselves
        assert all(token.split()[1] not in scope for token in token_users)


@pytest.mark.parametrize("door", ["middleware", "middleware-drf", "decorator"])
def test_unseen_credentials_can_be_refused(http, door, key, token_users, idempotency_settings):
    idempotency_settings(CREDENTIAL_SCOPE="refuse")
    refused = send(http, door, key, HTTP_AUTHORIZATION=token_users[0])
    assert refused.status_code == 400
    assert refused.json()["error"] == "idempotency_scope_unknown"
    assert not Widget.objects.exists()


# --- refusals before the view are never stored (issue: hardening) ---------------------------------


def test_a_csrf_failure_is_not_stored(key, settings):
    # CSRF checks before the idempotency middleware, as the docs ask.
    position = settings.MIDDLEWARE.index(
        "django_idempotency.request.middleware.IdempotencyMiddleware"
    )
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE[:position],
        "django.middleware.csrf.CsrfViewMiddleware",
        *settings.MIDDLEWARE[position:],
    ]
    strict = Client(enforce_csrf_checks=True)
    refused = send(strict, "middleware", key)
    assert refused.status_code == 403
    assert record_of(key) is None
    strict.get("/admin/login/")  # sets the CSRF cookie
    token = strict.cookies["csrftoken"].value
    accepted = send(strict, "middleware", key, HTTP_X_CSRFTOKEN=token)
    assert accepted.status_code == 201 and accepted["Idempotent-Replay"] == "false"


def test_a_path_that_resolves_to_no_view_is_never_claimed(http, key):
    response = http.post(
        "/doors/middleware/nowhere/", b"{}", "application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert response.status_code == 404
    assert record_of(key) is None


def test_a_drf_refusal_behind_the_middleware_is_not_stored(http, key):
    refused = send(http, "middleware-drf", key, HTTP_AUTHORIZATION="Token not-a-token")
    assert refused.status_code == 401
    assert record_of(key) is None


# --- log lines name the key and the path (issue: first hour) -----------------------------------


@pytest.mark.parametrize("door", ALL)
def test_replay_and_conflict_log_lines_carry_the_key_method_and_path(http, door, key, caplog):
    from django_idempotency.request.keys import redact

    send(http, door, key, name="a")
    with caplog.at_level("INFO", logger="django_idempotency.request"):
        send(http, door, key, name="a")
        send(http, door, key, name="b")
    lines = {
        record.idempotency_event: record
        for record in caplog.records
        if hasattr(record, "idempotency_event")
    }
    for event in ("replayed", "mismatched"):
        line = lines[event]
        assert line.idempotency_key == redact(key)
        assert line.idempotency_method == "POST"
        assert line.idempotency_path == doors.DOORS[door]
        assert key not in line.getMessage()


# --- Django's async test client: the ASGI handler, in process ------------------------------------


@pytest.mark.parametrize("door", ALL)
def test_the_async_client_gets_the_same_answers(door, key):
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    client = AsyncClient(raise_request_exception=False)

    def send_async(**body: Any) -> Any:
        return async_to_sync(client.post)(
            doors.DOORS[door],
            json.dumps(body),
            content_type="application/json",
            headers={"Idempotency-Key": key},
        )

    first = send_async(name="a", mode="rollback_once")
    assert first.status_code == 409 and first.json()["error"] == "declined"
    assert not Widget.objects.exists() and record_of(key) is None
    ran = send_async(name="a", mode="rollback_once")
    assert ran.status_code == 201 and ran["Idempotent-Replay"] == "false"
    replay = send_async(name="a", mode="rollback_once")
    assert replay["Idempotent-Replay"] == "true" and replay.content == ran.content
    assert send_async(name="b").status_code == 422
    assert Widget.objects.count() == 1
