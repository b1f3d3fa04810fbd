"""The decorator, the middleware (sync and async), ViewSets and ATOMIC_REQUESTS."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import AsyncClient, override_settings

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


def post_json(client, url, key, body, **extra):
    return client.post(
        url, json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY=key, **extra
    )


@pytest.mark.parametrize("url", ["/plain/function/", "/plain/middleware/", "/api/function/"])
def test_function_views_and_middleware_replay(client, key, url):
    first = post_json(client, url, key, {"name": "w"})
    second = post_json(client, url, key, {"name": "w"})
    assert first.status_code == 201 and first["Idempotent-Replay"] == "false"
    assert second.content == first.content and second["Idempotent-Replay"] == "true"
    assert second["Location"] == first["Location"]
    mismatch = post_json(client, url, key, {"name": "other"})
    assert mismatch.status_code == 422
    assert json.loads(mismatch.content)["error"] == "payload_mismatch"
    assert Widget.objects.count() == 1


@pytest.mark.parametrize("url", ["/plain/function/", "/plain/middleware/", "/api/function/"])
def test_function_views_and_middleware_roll_back_on_errors(client, key, url):
    client.raise_request_exception = False
    assert post_json(client, url, key, {"name": "w", "fail": True}).status_code == 500
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()


def test_plain_views_answer_problem_json(client):
    response = client.post("/plain/function/", b"{}", content_type="application/json")
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["error"] == "idempotency_key_missing"


def test_middleware_ignores_paths_it_does_not_guard(client, key, idempotency_settings):
    idempotency_settings(MIDDLEWARE_PATHS=[r"^/nothing/"])
    post_json(client, "/plain/middleware/", key, {"name": "w"})
    post_json(client, "/plain/middleware/", key, {"name": "w"})
    assert Widget.objects.count() == 2 and not IdempotencyRecord.objects.exists()


def test_mixin_behind_the_middleware_claims_once(client, key, idempotency_settings):
    idempotency_settings(MIDDLEWARE_PATHS=[r"^/api/widget/"])
    first = post_json(client, "/api/widget/", key, {"name": "w"})
    assert first.status_code == 201, first.content
    assert IdempotencyRecord.objects.count() == 1
    assert post_json(client, "/api/widget/", key, {"name": "w"}).content == first.content


def test_async_view_behind_the_middleware():
    client = AsyncClient()

    def send(body, key="async-key"):
        return async_to_sync(client.post)(
            "/async/widget/", json.dumps(body), content_type="application/json",
            headers={"Idempotency-Key": key},
        )  # fmt: skip

    first = send({"name": "a"})
    assert first.status_code == 201 and first["Idempotent-Replay"] == "false"
    replay = send({"name": "a"})
    assert replay.content == first.content and replay["Idempotent-Replay"] == "true"
    assert Widget.objects.count() == 1


def test_async_view_failure_rolls_back_its_async_orm_writes():
    client = AsyncClient(raise_request_exception=False)
    response = async_to_sync(client.post)(
        "/async/widget/", json.dumps({"name": "a", "fail": True}),
        content_type="application/json", headers={"Idempotency-Key": "async-fail"},
    )  # fmt: skip
    assert response.status_code == 500
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()


def test_viewset_create_and_partial_update(client, key):
    created = client.post("/api/widgets/", {"name": "w"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert created.status_code == 201
    pk = created.json()["id"]
    patched = client.patch(
        f"/api/widgets/{pk}/", {"name": "renamed"}, format="json", HTTP_IDEMPOTENCY_KEY="p-1"
    )
    again = client.patch(
        f"/api/widgets/{pk}/", {"name": "renamed"}, format="json", HTTP_IDEMPOTENCY_KEY="p-1"
    )
    assert patched.status_code == 200 and again["Idempotent-Replay"] == "true"
    assert client.put(f"/api/widgets/{pk}/", {"name": "x"}, format="json").status_code == 200
    assert IdempotencyRecord.objects.count() == 2  # PUT is not guarded by default


def test_atomic_requests_do_not_swallow_the_claim(client, key, gate):
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        started, release = gate("atomic")
        results = {}

        def first():
            results["first"] = post_json(client, "/api/widget/", key, {"name": "atomic"})
            connection.close()

        thread = threading.Thread(target=first)
        thread.start()
        assert started.wait(20)
        # The claim committed on its own: a duplicate sees it while the view still runs.
        results["second"] = post_json(client, "/api/widget/", key, {"name": "atomic"})
        release.set()
        thread.join(20)
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False
    assert results["second"].status_code == 409
    assert results["first"].status_code == 201
    assert Widget.objects.count() == 1


def overrun_the_lease(client, url, key, gate, idle_seconds):
    """Hold a request in its view past its lease, retry, then let the first one finish."""
    started, release = gate("slow")
    results = {}

    def first():
        results["first"] = post_json(client, url, key, {"name": "slow"})
        connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(20)
    time.sleep(idle_seconds)
    if connection.vendor == "sqlite":
        # Open the gate from a timer: on SQLite the retry may have to wait for the first
        # request's write lock, so this thread cannot be the one to release it. (Whenever the
        # retry comes, it finds the first request's answer: no race to lose.)
        opener = threading.Timer(1.0, release.set)
    else:
        # The first request runs on until the retry has taken the key over and is in the view
        # itself, or (below) has been answered: never before the retry, however late it comes.
        started.clear()
        opener = threading.Thread(target=lambda: started.wait(30) and release.set())
    opener.start()
    results["retry"] = post_json(client, url, key, {"name": "slow"})
    release.set()
    started.set()  # the opener's wait ends too
    thread.join(30)
    opener.join()
    return results


def test_heartbeat_keeps_a_slow_request_from_being_taken_over(client, idempotency_settings, gate):
    idempotency_settings(LEASE_SECONDS=1.5)
    results = overrun_the_lease(client, "/api/heartbeat-widget/", "hb", gate, idle_seconds=3.5)
    assert results["first"].status_code == 201
    if connection.vendor == "sqlite":
        # One writer at a time: the retry waited for the first request and replays it.
        assert results["retry"]["Idempotent-Replay"] == "true"
        assert results["retry"].content == results["first"].content
    else:
        assert results["retry"].status_code == 409
        assert results["retry"].json()["error"] == "transaction_in_progress"
    assert Widget.objects.count() == 1


def test_without_heartbeat_an_overrunning_request_loses_its_lease(
    client, idempotency_settings, gate
):
    idempotency_settings(LEASE_SECONDS=1.5)
    results = overrun_the_lease(client, "/api/widget/", "no-hb", gate, idle_seconds=2)
    if connection.vendor == "sqlite":
        # Nobody can take a key over while its request holds SQLite's write lock.
        assert results["first"].status_code == 201
        assert results["retry"].content == results["first"].content
    else:
        assert results["retry"].status_code == 201  # took the key over and ran
        assert results["first"].status_code == 409
        assert results["first"].json()["error"] == "idempotency_lease_lost"
    assert list(Widget.objects.values_list("name", flat=True)) == ["slow"]


def test_multipart_upload_is_fingerprinted_per_file(client, key):
    def upload(content: bytes):
        handle = io.BytesIO(content)
        handle.name = "doc.bin"
        return client.post(
            "/plain/upload/", {"name": "u", "file": handle}, HTTP_IDEMPOTENCY_KEY=key
        )

    first = upload(b"a" * 100_000)
    assert first.status_code == 201 and first.json()["sizes"] == {"file": 100_000}
    assert upload(b"a" * 100_000)["Idempotent-Replay"] == "true"
    assert upload(b"b" * 100_000).status_code == 422


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024, FILE_UPLOAD_MAX_MEMORY_SIZE=1024)
def test_a_raw_body_over_djangos_limit_is_refused_before_the_view(client, key):
    """The fingerprint reads no more than ``request.body`` would, even for a view that streams
    the body itself: that view opts in with ``request_fingerprint(max_body=...)``."""
    body = b"z" * 5_000_000
    response = client.post(
        "/plain/raw/", body, content_type="application/octet-stream", HTTP_IDEMPOTENCY_KEY=key
    )
    assert response.status_code == 400
    assert not Widget.objects.exists()
    assert not IdempotencyRecord.objects.filter(key=key).exists()


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024, FILE_UPLOAD_MAX_MEMORY_SIZE=1024)
def test_a_view_that_streams_its_body_can_accept_more_than_djangos_limit(client, key):
    """``@idempotent(max_body=None)``: hashed as it streams, spooled, and read by the view."""
    body = b"z" * 5_000_000
    first = client.post(
        "/plain/raw-stream/",
        body,
        content_type="application/octet-stream",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert first.status_code == 201 and first.json() == {"bytes": 5_000_000}
    again = client.post(
        "/plain/raw-stream/",
        body,
        content_type="application/octet-stream",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert again["Idempotent-Replay"] == "true"
    other = client.post(
        "/plain/raw-stream/",
        body[:-1] + b"y",
        content_type="application/octet-stream",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert other.status_code == 422
    assert Widget.objects.count() == 1


def test_signals_follow_the_requests(client, key):
    seen = []

    def recorder(name):
        return lambda **kwargs: seen.append((name, kwargs["key"]))

    names = ("key_claimed", "request_completed", "response_replayed", "payload_mismatched")
    receivers = {name: recorder(name) for name in names}
    for name, receiver in receivers.items():
        getattr(signals, name).connect(receiver)
    try:
        post_json(client, "/api/widget/", key, {"name": "w"})
        post_json(client, "/api/widget/", key, {"name": "w"})
        post_json(client, "/api/widget/", key, {"name": "v"})
    finally:
        for name, receiver in receivers.items():
            getattr(signals, name).disconnect(receiver)
    assert seen == [
        ("key_claimed", key),
        ("request_completed", key),
        ("response_replayed", key),
        ("payload_mismatched", key),
    ]


def test_logs_redact_keys_unless_configured(client, key, caplog, idempotency_settings):
    caplog.set_level("INFO", logger="django_idempotency")
    post_json(client, "/api/widget/", key, {"name": "w"})
    post_json(client, "/api/widget/", key, {"name": "w"})
    replay_logs = [r for r in caplog.records if r.idempotency_event == "replayed"]
    assert replay_logs and key not in replay_logs[0].idempotency_key
    assert key not in caplog.text
    idempotency_settings(LOG_KEYS=True)
    post_json(client, "/api/widget/", key, {"name": "w"})
    assert caplog.records[-1].idempotency_key == key


@pytest.mark.parametrize("url", ["/plain/function/", "/api/widget/"])
def test_atomic_requests_still_wrap_unguarded_methods(client, url):
    from django.db import transaction

    seen = []
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        from tests.testapp import views

        original = views.perform

        def spy(data, request):
            seen.append(transaction.get_connection().in_atomic_block)
            return original(data, request)

        views.perform = spy
        try:
            client.put(url, {"name": "w"}, format="json")
        finally:
            views.perform = original
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False
    assert seen == [True]
