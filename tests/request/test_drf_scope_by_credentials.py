"""``IdempotencyMixin.idempotency_scope_by_credentials``: a token client's keys scoped by a keyed
digest of its credentials, as behind the middleware, so that its replays are answered before
DRF's authentication, permissions and throttles; new requests are still checked before they
run, and the scope is exact: the same credentials, never only the same user."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import memory
from tests.request.test_redis_copy import configure
from tests.support.factories import UserFactory
from tests.testapp.models import Widget
from tests.testapp.views import CountingTokenAuthentication

pytestmark = pytest.mark.django_db(transaction=True)

SCOPED = "/api/credential-widget/"
BY_USER = "/api/token-widget/"


def token_for(user: Any) -> str:
    return f"Token {Token.objects.create(user=user).key}"


def post(path: str, key: str, authorization: str | None, name: str = "w") -> Any:
    headers = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization}
    return APIClient().post(
        path, {"name": name}, format="json", HTTP_IDEMPOTENCY_KEY=key, **headers
    )


def authentications() -> int:
    return CountingTokenAuthentication.calls


def test_a_replay_is_answered_before_drfs_authentication(key, django_assert_num_queries):
    token = token_for(UserFactory())
    first = post(SCOPED, key, token)
    assert first.status_code == 201, first.content
    before = authentications()
    with django_assert_num_queries(1):  # the claim's read; no token lookup
        retry = post(SCOPED, key, token)
    assert retry["Idempotent-Replay"] == "true"
    assert retry.content == first.content
    assert authentications() == before
    assert Widget.objects.count() == 1
    assert IdempotencyRecord.objects.get(key=key).scope.startswith("credentials:")


def test_control_scoped_by_the_user_a_replay_authenticates_first(key):
    token = token_for(UserFactory())
    assert post(BY_USER, key, token).status_code == 201
    before = authentications()
    assert post(BY_USER, key, token)["Idempotent-Replay"] == "true"
    assert authentications() == before + 1
    assert IdempotencyRecord.objects.get(key=key).scope.startswith("user:")


def test_a_new_request_is_authenticated_and_refused_before_it_runs_and_frees_its_key(key):
    refused = post(SCOPED, key, "Token not-a-token")
    assert refused.status_code == 401
    assert post(SCOPED, key, None).status_code == 401  # no credentials: DRF's user, none here
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert Widget.objects.count() == 0
    token = token_for(UserFactory())
    assert post(SCOPED, key, token).status_code == 201
    assert post(SCOPED, key, token)["Idempotent-Replay"] == "true"


def test_the_scope_is_the_credentials_never_only_the_user(key):
    """Another client's credentials run their own request, and so do the same user's new
    credentials: a replay goes only to the credentials that made it (revoked since, too: a
    replay is their own stored answer)."""
    user = UserFactory()
    first = token_for(user)
    assert post(SCOPED, key, first, name="a").status_code == 201
    response = post(SCOPED, key, token_for(UserFactory()), name="a")
    assert (response.status_code, response["Idempotent-Replay"]) == (201, "false")
    Token.objects.filter(user=user).delete()
    response = post(SCOPED, key, token_for(user), name="a")
    assert (response.status_code, response["Idempotent-Replay"]) == (201, "false")
    replay = post(SCOPED, key, first, name="a")
    assert replay.status_code == 201, replay.content
    assert replay["Idempotent-Replay"] == "true"
    assert Widget.objects.count() == 3


@pytest.mark.urls("tests.support.status_urls")
def test_the_status_view_finds_the_key_by_the_same_token(key):
    token = token_for(UserFactory())
    assert post(SCOPED, key, token).status_code == 201
    status = APIClient().get(f"/keys/idempotency-keys/{key}", HTTP_AUTHORIZATION=token)
    assert status.status_code == 200, status.content
    assert status.json()["status"] == "completed"


def test_with_redis_and_memory_replays_skip_drf_and_the_database(
    settings, redis_url, key, django_assert_num_queries
):
    configure(settings, redis_url, LOCAL_REPLAY_SECONDS=5)
    token = token_for(UserFactory())
    assert post(SCOPED, key, token).status_code == 201
    memory.clear()  # the completion kept the answer in memory; the database's replay copies it
    before = authentications()
    with django_assert_num_queries(1):
        assert post(SCOPED, key, token)["Idempotent-Replay"] == "true"  # to Redis and memory
    with django_assert_num_queries(0):
        assert post(SCOPED, key, token)["Idempotent-Replay"] == "true"  # from memory
    memory.clear()
    with django_assert_num_queries(0):
        assert post(SCOPED, key, token)["Idempotent-Replay"] == "true"  # from Redis
    assert authentications() == before
    assert Widget.objects.count() == 1


def test_with_credential_scope_refuse_the_keys_stay_the_users(key):
    with override_settings(IDEMPOTENCY={"CREDENTIAL_SCOPE": "refuse"}):
        token = token_for(UserFactory())
        assert post(SCOPED, key, token).status_code == 201
        before = authentications()
        assert post(SCOPED, key, token)["Idempotent-Replay"] == "true"
        assert authentications() == before + 1
    assert IdempotencyRecord.objects.get(key=key).scope.startswith("user:")


# --- claimed before DRF builds its request -----------------------------------------------------


def counted_steps(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str, failure: str
) -> list[str]:
    """The paths ``owner.name`` (a step of serving a DRF view) ran for; with ``fail`` appended,
    the step raises ``failure``."""
    ran: list[str] = []
    step = getattr(owner, name)

    def counted(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        ran.append(request.path)
        if "fail" in ran:
            raise RuntimeError(failure)
        return step(self, request, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return ran


@pytest.fixture
def drf_requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths DRF built a request for (``APIView.initialize_request``)."""
    from rest_framework.views import APIView

    return counted_steps(
        monkeypatch, APIView, "initialize_request", "DRF failed to build its request"
    )


def test_a_replay_is_sent_before_drf_builds_its_request_the_same_as_drf_would(
    key, drf_requests, django_assert_num_queries
):
    token = token_for(UserFactory())
    first = post(SCOPED, key, token)
    assert first.status_code == 201 and drf_requests == [SCOPED]
    with django_assert_num_queries(1):  # the claim's read
        retry = post(SCOPED, key, token)
    assert drf_requests == [SCOPED]  # none for the replay
    assert retry.status_code == 201 and retry.content == first.content
    assert retry["Idempotent-Replay"] == "true"
    for header in ("Content-Type", "Location", "Allow", "Vary"):
        assert retry[header] == first[header], header
    # Control: keys scoped by DRF's user are claimed inside DRF's request.
    assert post(BY_USER, key, token).status_code == 201
    assert post(BY_USER, key, token)["Idempotent-Replay"] == "true"
    assert drf_requests == [SCOPED, BY_USER, BY_USER]


def test_a_key_in_flight_claimed_before_drf_is_refused_by_drf(key, drf_requests):
    """A claim made before DRF's request that finds the key in flight is answered inside DRF,
    as a 409 with DRF's problem details; a malformed key is DRF's 400 the same way."""
    token = token_for(UserFactory())
    assert post(SCOPED, key, token).status_code == 201
    IdempotencyRecord.objects.filter(key=key).update(
        status="IN_PROGRESS", lease_expires_at=timezone.now() + timedelta(minutes=5)
    )
    conflict = post(SCOPED, key, token)
    assert conflict.status_code == 409, conflict.content
    assert conflict["Content-Type"] == "application/problem+json"
    assert "Retry-After" in conflict
    malformed = post(SCOPED, "x" * 1000, token)
    assert malformed.status_code == 400, malformed.content
    assert malformed["Content-Type"] == "application/problem+json"
    assert drf_requests == [SCOPED] * 3  # both answered through DRF's own handling
    assert Widget.objects.count() == 1


def test_a_duplicate_claimed_before_drf_passes_drfs_checks_before_it_may_wait(
    key, monkeypatch: pytest.MonkeyPatch
):
    """A key in flight, met before DRF's request by a duplicate asking to wait: DRF
    authenticates it first. A revoked token (same credentials, same scope) gets DRF's 401 and
    never waits; a valid one waits (control)."""
    from django_idempotency.request import attach

    enlisted: list[str] = []
    enlist = attach.enlist

    def counted(request: Any, identity: Any, *args: Any) -> Any:
        enlisted.append(identity.key)
        return enlist(request, identity, *args)

    monkeypatch.setattr(attach, "enlist", counted)
    user = UserFactory()
    token = token_for(user)
    assert post(SCOPED, key, token).status_code == 201
    IdempotencyRecord.objects.filter(key=key).update(
        status="IN_PROGRESS", lease_expires_at=timezone.now() + timedelta(minutes=5)
    )
    headers = {"HTTP_AUTHORIZATION": token, "HTTP_PREFER": "wait=1"}
    Token.objects.filter(user=user).delete()
    refused = APIClient().post(
        SCOPED, {"name": "w"}, format="json", HTTP_IDEMPOTENCY_KEY=key, **headers
    )
    assert refused.status_code == 401, refused.content
    assert enlisted == []
    Token.objects.create(user=user, key=token.removeprefix("Token "))
    waited = APIClient().post(
        SCOPED, {"name": "w"}, format="json", HTTP_IDEMPOTENCY_KEY=key, **headers
    )
    assert waited.status_code == 409, waited.content  # still in flight after its wait
    assert enlisted == [key]
    assert Widget.objects.count() == 1


# --- claimed before the view is built ---------------------------------------------------------


@pytest.fixture
def built_views(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths a view was built for (Django's ``View.setup``)."""
    from django.views.generic import View

    return counted_steps(monkeypatch, View, "setup", "the view failed to build")


def call(view: Any, key: str, token: str, name: str = "w") -> Any:
    """``view`` called directly, as Django calls the view function it resolved."""
    from rest_framework.test import APIRequestFactory

    request = APIRequestFactory().post(
        SCOPED, {"name": name}, format="json", HTTP_IDEMPOTENCY_KEY=key, HTTP_AUTHORIZATION=token
    )
    response = view(request)
    if hasattr(response, "render"):
        response.render()
    return response


def test_after_its_first_request_a_view_function_replays_before_it_builds_the_view(
    key, built_views
):
    """The view function keeps what its claims need after its first request: a replay is
    then sent before Django and DRF build the view, with the headers DRF's path sends."""
    from tests.testapp.views import CredentialScopedWidgetView

    view = CredentialScopedWidgetView.as_view()  # a view function of its own: nothing kept yet
    token = token_for(UserFactory())
    first = call(view, key, token)
    assert first.status_code == 201 and built_views == [SCOPED]
    retry = call(view, key, token)
    assert built_views == [SCOPED]  # not built for the replay
    assert retry["Idempotent-Replay"] == "true" and retry.content == first.content
    for header in ("Content-Type", "Location", "Allow", "Vary"):
        assert retry[header] == first[header], header
    # A new key is claimed before the view is built, then served by it: claimed once.
    other = call(view, f"{key}-2", token, name="v")
    assert other.status_code == 201 and built_views == [SCOPED, SCOPED]
    assert IdempotencyRecord.objects.filter(key=f"{key}-2").count() == 1
    assert call(view, f"{key}-2", token, name="v").content == other.content
    assert built_views == [SCOPED, SCOPED] and Widget.objects.count() == 2


def test_a_streamed_answer_replayed_before_the_view_is_built_carries_drfs_headers(key):
    """A streamed first answer is not retained: its replay says so, with DRF's ``Allow`` and
    ``Vary`` as DRF's path adds them to any answer."""
    from rest_framework.test import APIRequestFactory

    from tests.testapp.views import CredentialScopedWidgetView

    view = CredentialScopedWidgetView.as_view()
    token = token_for(UserFactory())
    assert call(view, f"{key}-0", token).status_code == 201  # the view function keeps its claims

    def streamed() -> Any:
        request = APIRequestFactory().post(
            SCOPED, {"name": "w", "stream": True}, format="json",
            HTTP_IDEMPOTENCY_KEY=key, HTTP_AUTHORIZATION=token,
        )  # fmt: skip
        return view(request)

    first = streamed()
    assert first.streaming and first.status_code == 200
    retry = streamed()
    assert retry["Idempotent-Replay"] == "true" and retry.status_code == 200
    assert b"response_not_retained" in retry.content
    for header in ("Allow", "Vary"):
        assert retry[header] == first[header], header


def test_what_a_view_function_keeps_holds_no_view_nor_its_request(key):
    """The view function keeps its claims for good: they must not keep the view its first
    request built alive, nor that request. (Control: with the view's own ``should_store``
    hook kept in the claims' options, the view stays alive.)"""
    import gc

    from tests.testapp.views import CredentialScopedWidgetView

    class Kept(CredentialScopedWidgetView):
        pass

    view = Kept.as_view()
    assert call(view, key, token_for(UserFactory())).status_code == 201
    assert call(view, key, token_for(UserFactory())).status_code == 201  # kept by now
    gc.collect()
    assert not [alive for alive in gc.get_objects() if type(alive) is Kept]


def test_control_a_view_that_builds_itself_its_own_way_replays_after_it_is_built(key, built_views):
    """A view class with a ``setup`` of its own may set things a claim depends on: its view
    function keeps nothing, and each replay is sent once the view is built (still before DRF's
    request), with the same headers."""
    from tests.testapp.views import CredentialScopedWidgetView

    class BuiltItsOwnWay(CredentialScopedWidgetView):
        def setup(self, request: Any, *args: Any, **kwargs: Any) -> None:
            super().setup(request, *args, **kwargs)

    view = BuiltItsOwnWay.as_view()
    token = token_for(UserFactory())
    first = call(view, key, token)
    retry = call(view, key, token)
    assert built_views == [SCOPED, SCOPED]
    assert retry["Idempotent-Replay"] == "true" and retry.content == first.content
    for header in ("Content-Type", "Location", "Allow", "Vary"):
        assert retry[header] == first[header], header


def test_a_replay_before_the_view_adds_drfs_vary_to_a_stored_one(key, idempotency_settings):
    """With ``Vary`` among the stored headers, DRF adds its own to it on a replay, as it did on
    the first answer; sent before the view is built, the replay's is the same. (Control: with
    DRF's ``Vary`` set over the stored one instead of added, this fails.)"""
    from tests.testapp.views import CredentialScopedWidgetView

    class VariesByCookie(CredentialScopedWidgetView):
        def post(self, request: Any) -> Any:
            response = super().post(request)
            response["Vary"] = "Cookie"
            return response

    idempotency_settings(STORED_RESPONSE_HEADERS=["Content-Type", "Location", "Vary"])
    view = VariesByCookie.as_view()
    token = token_for(UserFactory())
    first = call(view, key, token)
    assert first["Vary"] == "Cookie, Accept"
    retry = call(view, key, token)
    assert retry["Idempotent-Replay"] == "true" and retry["Vary"] == "Cookie, Accept"


@pytest.mark.parametrize(
    ("owner", "step", "kept"),
    [
        ("rest_framework.views.APIView", "initialize_request", False),
        ("rest_framework.views.APIView", "initialize_request", True),
        ("django.views.generic.View", "setup", True),
    ],
    ids=["claimed-in-dispatch-drf-fails", "claimed-first-drf-fails", "claimed-first-view-fails"],
)
def test_a_key_claimed_before_drf_is_given_back_when_serving_fails_before_it_runs(
    key, monkeypatch, owner, step, kept
):
    """Claimed in ``dispatch`` (a view function's first request) or before the view is built
    (once it keeps its claims), a key whose request then fails, before DRF's request is built
    or before the view is, is given back at once, not held until its lease."""
    from importlib import import_module

    from tests.testapp.views import CredentialScopedWidgetView

    module, name = owner.rsplit(".", 1)
    ran = counted_steps(monkeypatch, getattr(import_module(module), name), step, "failed here")
    view = CredentialScopedWidgetView.as_view()
    token = token_for(UserFactory())
    if kept:
        assert call(view, f"{key}-0", token).status_code == 201  # the function keeps its claims
    ran.append("fail")
    with pytest.raises(RuntimeError, match="failed here"):
        call(view, key, token)
    assert not IdempotencyRecord.objects.filter(key=key).exists()  # not held until its lease
    ran.remove("fail")
    assert call(view, key, token).status_code == 201  # a retry runs at once, no 409
    assert Widget.objects.count() == 1 + kept


@pytest.mark.parametrize(
    ("method", "route", "allow"),
    [
        ("post", "/api/credential-widgets/", "GET, POST, HEAD, OPTIONS"),
        ("patch", "/api/credential-widgets/{pk}/", "GET, PUT, PATCH, DELETE, HEAD, OPTIONS"),
    ],
)
def test_each_route_of_a_viewset_replays_with_its_own_allow(key, method, route, allow):
    """A viewset binds its actions per route: what a view function keeps is its route's."""
    user = UserFactory()
    token = token_for(user)
    widget = Widget.objects.create(name="w")
    path = route.format(pk=widget.pk)
    client = APIClient()

    def send() -> Any:
        return getattr(client, method)(
            path, {"name": "x"}, format="json", HTTP_IDEMPOTENCY_KEY=key, HTTP_AUTHORIZATION=token
        )

    send()  # a first key: the route's view function keeps its claims
    first = send()
    retry = send()
    assert first.status_code in (200, 201), first.content
    assert retry["Idempotent-Replay"] == "true" and retry.content == first.content
    assert first["Allow"] == retry["Allow"] == allow


def test_behind_the_middleware_a_view_scoped_by_credentials_is_guarded_once(
    key, idempotency_settings
):
    idempotency_settings(MIDDLEWARE_PATHS=[r"^/api/credential-widget/"])
    token = token_for(UserFactory())
    post(SCOPED, f"{key}-0", token)  # the view function keeps its claims
    first = post(SCOPED, key, token)
    assert first.status_code == 201, first.content
    assert IdempotencyRecord.objects.filter(key=key).count() == 1
    retry = post(SCOPED, key, token)
    assert retry["Idempotent-Replay"] == "true" and retry.content == first.content
    assert Widget.objects.count() == 2


# --- the digest itself -------------------------------------------------------------------------


def test_the_credentials_digest_is_django_s_salted_hmac_under_the_secret_key() -> None:
    """The scope is ``salted_hmac`` of the credentials under ``SECRET_KEY``: records written by
    an earlier version keep their scope, and a new secret gives every client a new one."""
    from django.utils.crypto import salted_hmac

    from django_idempotency.request.scopes import _CREDENTIALS_SALT, _digest_scope

    credentials = ["Token abc", "é"]

    def expected() -> str:
        digest = salted_hmac(_CREDENTIALS_SALT, "\n".join(credentials), algorithm="sha256")
        return f"credentials:{digest.hexdigest()[:40]}"

    before = _digest_scope(credentials)
    assert before == expected()
    with override_settings(SECRET_KEY="another secret " + "x" * 50):
        assert _digest_scope(credentials) == expected() != before
    assert _digest_scope(credentials) == before
