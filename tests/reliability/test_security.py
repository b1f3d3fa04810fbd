"""Security properties: tenants never see each other's responses, credentials are never stored
or replayed, stored bodies are capped, the admin's actions need their permissions, and logs never
show a raw key unless ``LOG_KEYS`` says so."""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.http import HttpResponse
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from django_idempotency.checks import W002, check_settings
from django_idempotency.conf import SENSITIVE_HEADERS
from django_idempotency.core import types
from django_idempotency.db.querysets import PROCESSING, OutboxStatus
from django_idempotency.exceptions import LeaseLostConflict
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.request import lifecycle, store
from django_idempotency.request.fingerprint import request_fingerprint
from tests.reliability.corpus import PRINTABLE, bounded
from tests.support.admin_support import login, post_action
from tests.support.factories import (
    IdempotencyRecordFactory,
    OutboxEventFactory,
    ProcessedMessageFactory,
    held_elsewhere,
)
from tests.testapp.hostile_views import LEAKY_HEADERS
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

PROBLEM = "application/problem+json"


def tenant_scope(request: Any) -> str:
    """A multi-tenant resolver as docs/howto/multi-tenant.md describes: the user when there is
    one, else the tenant the (trusted, e.g. gateway-set) ``X-Tenant`` header names."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    tenant = request.META.get("HTTP_X_TENANT")
    return f"tenant:{tenant}" if tenant else "anonymous"


# --- tenants ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Principal:
    name: str
    #: A username (authenticated through DRF) or an ``X-Tenant`` value.
    user: str | None = None
    tenant: str | None = None


LONG = "t" * 300
PRINCIPALS = [
    Principal("alice", user="alice"),
    Principal("bob", user="bob"),
    Principal("acme", tenant="acme"),
    Principal("globex", tenant="globex"),
    # Spoofs: a tenant named like another principal's scope must not share it.
    Principal("spoof-user", tenant="user:1"),
    Principal("spoof-tenant", tenant="tenant:acme"),
    # Scopes past 255 characters are hashed; these differ only in their last character.
    Principal("long-a", tenant=LONG + "a"),
    Principal("long-b", tenant=LONG + "b"),
]
TENANT_ENDPOINTS = ["/api/hostile/", "/api/hostile-function/", "/plain/hostile/"]


@dataclass(frozen=True)
class Call:
    principal: Principal
    key: int
    endpoint: str
    body: str


calls = st.builds(
    Call,
    st.sampled_from(PRINCIPALS),
    st.integers(0, 2),
    st.sampled_from(TENANT_ENDPOINTS),
    st.sampled_from(["a", "b"]),
)


@bounded(40)
@given(sequence=st.lists(calls, min_size=2, max_size=10))
def test_a_tenant_never_receives_another_tenants_response(
    sequence: list[Call], idempotency_settings: Any
) -> None:
    """Model-based: each (principal, key) runs once, later calls replay exactly that first
    response or are a 422 for another request; nobody is ever answered with someone else's."""
    idempotency_settings(SCOPE_RESOLVER="tests.reliability.test_security.tenant_scope")
    users = {name: User.objects.get_or_create(username=name)[0] for name in ("alice", "bob")}
    prefix = uuid.uuid4().hex[:8]
    first: dict[tuple[str, int], tuple[Call, int, bytes]] = {}
    for call in sequence:
        client = APIClient()
        headers: dict[str, str] = {"HTTP_IDEMPOTENCY_KEY": f"{prefix}-{call.key}"}
        if call.principal.user is not None:
            if call.endpoint.startswith("/plain/"):
                client.force_login(users[call.principal.user])
            else:
                client.force_authenticate(users[call.principal.user])
            expected_tenant = f"user:{users[call.principal.user].pk}"
        else:
            headers["HTTP_X_TENANT"] = str(call.principal.tenant)
            expected_tenant = str(call.principal.tenant)
        widgets = Widget.objects.count()
        response = client.post(call.endpoint, {"name": call.body}, format="json", **headers)
        slot = (call.principal.name, call.key)
        if slot not in first:
            assert response.status_code == 201, response.content
            assert response["Idempotent-Replay"] == "false"
            assert json.loads(response.content)["tenant"] == expected_tenant
            assert Widget.objects.count() == widgets + 1
            first[slot] = (call, response.status_code, response.content)
            continue
        original, status, content = first[slot]
        assert Widget.objects.count() == widgets, "a retry ran the view again"
        if (original.endpoint, original.body) == (call.endpoint, call.body):
            assert response["Idempotent-Replay"] == "true"
            assert (response.status_code, response.content) == (status, content)
            assert json.loads(response.content)["tenant"] == expected_tenant
        else:
            assert response.status_code == 422, response.content
            assert json.loads(response.content)["error"] == "payload_mismatch"
    scopes = set(IdempotencyRecord.objects.values_list("scope", flat=True))
    assert len(scopes) <= len(PRINCIPALS) and all(len(scope) <= 255 for scope in scopes)


# --- credentials in response headers ----------------------------------------------------------


def mixed_case(name: str, flips: list[bool]) -> str:
    return "".join(c.upper() if flip else c.lower() for c, flip in zip(name, flips, strict=False))


sensitive_names = st.lists(
    st.builds(
        mixed_case,
        st.sampled_from(sorted(LEAKY_HEADERS)),
        st.lists(st.booleans(), min_size=20, max_size=20),
    ),
    min_size=1,
    max_size=8,
)


@bounded(30)
@given(asked=sensitive_names)
def test_credentials_are_never_stored_or_replayed(
    asked: list[str], idempotency_settings: Any
) -> None:
    """Whatever case STORED_RESPONSE_HEADERS spells them in, Set-Cookie, Cookie, Authorization,
    Proxy-Authorization and the authenticate challenges are not stored; the check warns."""
    idempotency_settings(STORED_RESPONSE_HEADERS=["Content-Type", "Location", *asked])
    assert [message.id for message in check_settings()] == [W002]
    client = Client()
    key = f"leak-{uuid.uuid4()}"
    first = client.post(
        "/plain/leaky/", {}, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert first.status_code == 201
    assert first["Authorization"] == LEAKY_HEADERS["Authorization"]  # the first answer is the
    assert first.cookies  # view's own: only what is stored and replayed is filtered
    record = IdempotencyRecord.objects.get(key=key)
    stored = {name.lower() for name, _value in record.response_headers}
    assert stored == {"content-type", "location"}, record.response_headers
    assert "secret" not in json.dumps(record.response_headers)
    replay = client.post(
        "/plain/leaky/", {}, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert replay["Idempotent-Replay"] == "true" and replay.content == first.content
    assert not {name.lower() for name in replay.headers} & SENSITIVE_HEADERS
    assert not replay.cookies
    assert replay["Location"] == first["Location"]


def test_credentials_are_not_replayed_through_drf_either(idempotency_settings: Any) -> None:
    """DRF's Response and ``set_cookie`` take another path to the headers; same outcome."""
    idempotency_settings(
        STORED_RESPONSE_HEADERS=["Content-Type", "Set-Cookie", "Authorization", "X-Widget-Id"]
    )
    client = APIClient()
    key = f"leak-{uuid.uuid4()}"
    first = client.post("/api/widget/", {"name": "w"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.cookies["session-ish"].value == "secret"
    replay = client.post("/api/widget/", {"name": "w"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert replay["Idempotent-Replay"] == "true"
    assert not replay.cookies and not replay.has_header("Set-Cookie")
    names = [name.lower() for name, _ in IdempotencyRecord.objects.get(key=key).response_headers]
    assert sorted(names) == ["content-type", "x-widget-id"]


# --- the response size cap --------------------------------------------------------------------

CAP = 2000
sizes = st.one_of(
    st.integers(CAP - 40, CAP + 40),
    st.sampled_from([0, 1, CAP - 1, CAP, CAP + 1, 10 * CAP, 200 * CAP]),
    st.integers(0, 4 * CAP),
)


@bounded(40)
@given(size=sizes, status=st.sampled_from([200, 201, 409, 422]))
def test_stored_bodies_are_capped_by_max_response_bytes(
    size: int, status: int, idempotency_settings: Any
) -> None:
    """docs/settings.md: a body over MAX_RESPONSE_BYTES is not stored; the record keeps the
    status, and a retry gets that status with a problem body saying it was not retained, without
    running the view again. At or under the cap, the replay is byte for byte."""
    idempotency_settings(MAX_RESPONSE_BYTES=CAP)
    client = Client()
    key = f"cap-{uuid.uuid4()}"
    body = {"size": size, "status": status}
    first = client.post(
        "/plain/leaky/", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert first.status_code == status
    if size > 60:
        assert len(first.content) == size  # the view pads to the size asked for
    record = IdempotencyRecord.objects.get(key=key)
    assert len(bytes(record.response_body or b"")) <= CAP
    assert record.response_status == status
    widgets = Widget.objects.count()
    replay = client.post(
        "/plain/leaky/", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert Widget.objects.count() == widgets
    assert replay.status_code == status and replay["Idempotent-Replay"] == "true"
    if len(first.content) <= CAP:
        assert record.response_retained and replay.content == first.content
    else:
        assert not record.response_retained
        assert replay["Content-Type"] == PROBLEM
        assert json.loads(replay.content)["error"] == "response_not_retained"
        assert replay["Location"] == first["Location"]  # allowed headers are kept


def test_streamed_bodies_are_not_stored_either(client: Any) -> None:
    key = f"stream-{uuid.uuid4()}"
    body = {"name": "w", "stream": True}
    first = client.post("/plain/function/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert b"".join(first.streaming_content).startswith(b"streamed")
    assert IdempotencyRecord.objects.get(key=key).response_body in (None, b"")
    replay = client.post("/plain/function/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert json.loads(replay.content)["error"] == "response_not_retained"
    assert Widget.objects.count() == 1


# --- admin actions and permissions ------------------------------------------------------------

PERMISSION_KINDS = ("view", "change", "delete")


def subsets() -> Iterator[tuple[str, ...]]:
    for size in range(len(PERMISSION_KINDS) + 1):
        yield from itertools.combinations(PERMISSION_KINDS, size)


def changelist(model: type[Any]) -> str:
    return reverse(f"admin:django_idempotency_{model._meta.model_name}_changelist")


@dataclass(frozen=True)
class AdminAction:
    model: type[Any]
    action: str
    needs: str
    #: Extra form fields (``post=yes`` answers a confirmation page).
    extra: tuple[tuple[str, str], ...] = ()


ACTIONS = [
    AdminAction(IdempotencyRecord, "release_keys", "delete"),
    AdminAction(IdempotencyRecord, "force_release_keys", "delete", (("post", "yes"),)),
    AdminAction(OutboxEvent, "retry_events", "change"),
    AdminAction(OutboxEvent, "discard_events", "delete", (("post", "yes"),)),
    AdminAction(ProcessedMessage, "delete_selected", "never", (("post", "yes"),)),
]


def target(action: AdminAction) -> Any:
    """A fresh row the action would change; returns it."""
    if action.model is IdempotencyRecord:
        running = action.action == "force_release_keys"
        return IdempotencyRecordFactory(stuck=not running, running=running)
    if action.model is OutboxEvent:
        return OutboxEventFactory(dead=True)
    return ProcessedMessageFactory()


def changed(action: AdminAction, row: Any) -> bool:
    current = action.model.objects.filter(pk=row.pk).first()
    if current is None:
        return True
    return bool(action.model is OutboxEvent and current.status != OutboxStatus.DEAD)


@pytest.mark.parametrize("action", ACTIONS, ids=[action.action for action in ACTIONS])
def test_admin_actions_need_their_permission(action: AdminAction) -> None:
    """Every subset of view/change/delete for a staff user: the changelist opens with view or
    change, and the action changes its row only with the permission it declares (the processed
    messages admin has no action at all, even for a superuser)."""
    model = action.model._meta.model_name
    url = changelist(action.model)
    for granted in [*subsets(), ("superuser",)]:
        if granted == ("superuser",):
            client = login(superuser=True)
        else:
            client = login(*(f"{kind}_{model}" for kind in granted))
        row = target(action)
        page = client.get(url)
        can_open = granted == ("superuser",) or bool({"view", "change"} & set(granted))
        assert page.status_code == (200 if can_open else 403), (granted, page.status_code)
        response = post_action(client, url, action.action, [row], **dict(action.extra))
        allowed = (
            can_open
            and action.needs != "never"
            and (action.needs in granted or granted == ("superuser",))
        )
        assert changed(action, row) == allowed, (action.action, granted)
        if not can_open:
            assert response.status_code == 403
    for anonymous_or_not_staff in (Client(), _not_staff_with_every_permission(model)):
        row = target(action)
        response = post_action(anonymous_or_not_staff, url, action.action, [row])
        assert not changed(action, row)
        assert response.redirect_chain and "/login/" in response.redirect_chain[-1][0]


def _not_staff_with_every_permission(model: str) -> Client:
    client = login(*(f"{kind}_{model}" for kind in PERMISSION_KINDS))
    user = User.objects.get(pk=client.session["_auth_user_id"])
    user.is_staff = False
    user.save()
    return client


def test_processed_messages_cannot_be_edited_even_by_a_superuser() -> None:
    client = login(superuser=True)
    message = ProcessedMessageFactory()
    url = reverse("admin:django_idempotency_processedmessage_change", args=[message.pk])
    assert client.post(url, {"consumer": "x", "message_id": "y"}).status_code == 403
    delete = reverse("admin:django_idempotency_processedmessage_delete", args=[message.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403
    assert ProcessedMessage.objects.filter(pk=message.pk, consumer=message.consumer).exists()


def test_hostile_keys_and_bodies_are_escaped_in_the_admin() -> None:
    """A key, path and stored body an attacker chose are shown as text, never as markup."""
    script = "<script>alert(1)</script>"
    record = IdempotencyRecordFactory(
        key=script,
        path="/p/<img src=x onerror=alert(1)>",
        response_body=json.dumps({"a": "</pre>" + script}).encode(),
        response_headers=[["Content-Type", "text/html"], ["Location", script]],
    )
    client = login(superuser=True)
    for url in (
        changelist(IdempotencyRecord),
        reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk]),
    ):
        html = client.get(url).content.decode()
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert script not in html and "<img src=x" not in html


# --- logs ------------------------------------------------------------------------------------


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def texts(self) -> Iterator[str]:
        formatter = logging.Formatter()
        for record in self.records:
            yield formatter.format(record)
            yield from (repr(value) for value in vars(record).values())


@pytest.fixture
def captured() -> Iterator[Collect]:
    """Every record of the django_idempotency loggers, at DEBUG."""
    handler = Collect()
    logger = logging.getLogger("django_idempotency")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def exercise_every_keyed_log_line(key: str) -> None:
    """Replay, mismatch, conflict, takeover and lease lost, each logged with the key."""
    client = Client()
    body = b'{"name": "w"}'

    def post(the_key: str, content: bytes = body) -> int:
        response = client.post(
            "/plain/hostile/", content, content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=the_key,
        )  # fmt: skip
        return response.status_code

    assert post(key) == 201
    assert post(key) == 201  # replay
    assert post(key, b'{"name": "other"}') == 422  # mismatch
    request = RequestFactory().generic("POST", "/plain/hostile/", body, "application/json")
    running = lifecycle.identify(
        request, f"{key}-2", scope="anonymous", fingerprint=request_fingerprint(request)
    )
    with held_elsewhere(running) as lease:  # a request still running on another connection
        assert isinstance(lease, types.Proceed)
        assert post(f"{key}-2") == 409  # conflict
        _expire_lease(running)
        assert post(f"{key}-2") == 201  # takeover
    lost = lifecycle.identify(request, f"{key}-3", scope="anonymous", fingerprint="0" * 64)
    stale = lifecycle.claim(lost)
    assert isinstance(stale, types.Proceed)
    _expire_lease(lost)
    current = lifecycle.claim(lost)
    assert isinstance(current, types.Proceed)
    with pytest.raises(LeaseLostConflict):
        lifecycle.run(stale.lease, lambda: HttpResponse(b"late", status=201))
    store.release(current.lease)


def _expire_lease(identity: types.Identity) -> None:
    IdempotencyRecord.objects.filter(scope=identity.scope, key=identity.key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


keys = st.text(st.sampled_from(PRINTABLE), min_size=12, max_size=200).map(lambda k: f"K{k}")
EVENTS = {"replayed", "mismatched", "conflicted", "taken_over", "lease_lost"}


@bounded(20)
@given(key=keys)
def test_logs_never_show_a_raw_key(key: str, captured: Collect) -> None:
    """By default every log line carries a redacted key: the raw one appears nowhere, not in
    the message, not in an extra field, not in a traceback."""
    captured.records.clear()
    exercise_every_keyed_log_line(key)
    events = {getattr(record, "idempotency_event", None) for record in captured.records}
    assert events >= EVENTS, events
    for text in captured.texts():
        assert key not in text, text


@bounded(5)
@given(key=keys)
def test_log_keys_shows_raw_keys(key: str, captured: Collect, idempotency_settings: Any) -> None:
    """The same log lines with ``LOG_KEYS = True`` carry the raw key (so the redaction above is
    the setting at work, not keys that never reach the logs)."""
    idempotency_settings(LOG_KEYS=True)
    captured.records.clear()
    exercise_every_keyed_log_line(key)
    logged = {getattr(record, "idempotency_key", None) for record in captured.records}
    assert {key, f"{key}-2", f"{key}-3"} <= logged


def test_no_processing_record_is_left_by_this_module() -> None:
    """A guard on the helpers above: they release what they claim."""
    started = time.monotonic()
    exercise_every_keyed_log_line(f"K-{uuid.uuid4()}")
    assert not IdempotencyRecord.objects.filter(status=PROCESSING).exists()
    print(f"\none keyed-log scenario: {time.monotonic() - started:.2f} s")
