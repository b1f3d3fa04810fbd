"""Attach instead of 409: a duplicate of a request in flight that may wait (``Prefer: wait=N``
or a view's default) gets what a retry would get once the first is done, on every door, with
real threads against the real database (and with the Redis copy enabled).

The first request is held inside its view by a gate (``tests/testapp/doors.py``, ``hold``);
the duplicate is sent from another thread and is known to be waiting once the attach registry
counts it. Async doors run through Django's test client (the handler drives them on an event
loop as ASGI would); ``test_asgi_duplicate_attaches`` drives them under uvicorn.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext

from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import attach
from tests.testapp import doors
from tests.testapp.models import Widget

ON_SQLITE = connection.vendor == "sqlite"

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.concurrency]

DOORS = ["middleware", "middleware-drf", "decorator", "decorator-async", "api-function", "mixin"]


def send(door: str, key: str, *, prefer: str | None = None, **body: Any) -> Any:
    """One POST from a client of its own, the connection closed after (a thread's own)."""
    headers = {"HTTP_IDEMPOTENCY_KEY": key}
    if prefer is not None:
        headers["HTTP_PREFER"] = prefer
    try:
        return Client(raise_request_exception=False).post(
            doors.DOORS[door], json.dumps(body), content_type="application/json", **headers
        )
    finally:
        connection.close()


class InThread:
    """A request sent from its own thread; ``result()`` joins it."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.response: Any = None
        self.error: BaseException | None = None

        def target() -> None:
            try:
                self.response = call()
            except BaseException as exc:  # pragma: no cover - reported by result()
                self.error = exc

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the request never finished"
        if self.error is not None:
            raise self.error
        return self.response


def until(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(params=["database", "redis"])
def store(request: Any, settings: Any) -> str:
    """Every attach test with the records alone, and with the Redis copy of completed ones."""
    if request.param == "redis":
        from tests.request.test_redis_copy import configure

        configure(settings, request.getfixturevalue("redis_url"))
    return str(request.param)


@pytest.fixture
def held(gate: Any, key: str) -> Callable[..., tuple[InThread, threading.Event, dict[str, Any]]]:
    """Start the first request of ``key`` on a door and hold it inside its view; returns its
    thread, the gate that lets it go, and its body (a duplicate sends the same)."""

    def start(door: str, **body: Any) -> tuple[InThread, threading.Event, dict[str, Any]]:
        body["hold"] = f"hold-{uuid.uuid4().hex[:8]}"
        started, opened = gate(body["hold"])
        first = InThread(lambda: send(door, key, **body))
        assert started.wait(20), "the first request never reached its view"
        return first, opened, body

    return start


def waiters(count: int) -> Callable[[], bool]:
    return lambda: attach.waiting() == count


@pytest.fixture(autouse=True)
def no_waiter_left() -> Iterator[None]:
    yield
    until(waiters(0), "the waiters to leave")


@pytest.fixture(autouse=True, scope="module")
def no_poller_left() -> Iterator[None]:
    """The poller closes its connection when it stops; the test database can only be dropped
    once no connection to it is left."""
    yield
    until(lambda: attach._registry.poller is None, "the poller to stop")


# --- a duplicate attaches to the request in flight ----------------------------------------------


@pytest.mark.parametrize("door", DOORS)
def test_a_duplicate_that_waits_gets_the_firsts_response_as_a_replay(door, key, held, store):
    first, opened, body = held(door, name="attach")
    duplicate = InThread(lambda: send(door, key, prefer="wait=5", **body))
    until(waiters(1), "the duplicate to wait")
    opened.set()
    original, attached = first.result(), duplicate.result()
    assert original.status_code == 201, original.content
    assert original["Idempotent-Replay"] == "false"
    assert attached.status_code == 201, attached.content
    assert attached["Idempotent-Replay"] == "true"
    assert attached.content == original.content
    assert attached["Preference-Applied"] == "wait=5"
    assert "Preference-Applied" not in original
    assert doors.calls[key] == 1
    assert Widget.objects.filter(name="attach").count() == 1


@pytest.mark.parametrize("door", ["decorator", "decorator-async", "mixin"])
def test_a_views_default_wait_attaches_without_prefer(door, key, held, idempotency_settings):
    """The middleware and the doors without options take the setting; the header is only said
    when the request asked (RFC 7240: it answers a ``Prefer``)."""
    idempotency_settings(ATTACH_DEFAULT_WAIT_SECONDS=5)
    first, opened, body = held(door, name="default")
    duplicate = InThread(lambda: send(door, key, **body))
    until(waiters(1), "the duplicate to wait")
    opened.set()
    assert first.result().status_code == 201
    attached = duplicate.result()
    assert (attached.status_code, attached["Idempotent-Replay"]) == (201, "true")
    assert "Preference-Applied" not in attached
    assert doors.calls[key] == 1


def test_prefer_wait_0_opts_out_of_a_default(key, held, idempotency_settings):
    idempotency_settings(ATTACH_DEFAULT_WAIT_SECONDS=5)
    first, opened, body = held("decorator")
    try:
        refused = send("decorator", key, prefer="wait=0", **body)
        assert refused.status_code == 409
    finally:
        opened.set()
    assert first.result().status_code == 201


@pytest.mark.parametrize("door", DOORS)
def test_when_the_first_fails_the_waiter_runs_the_view_itself(door, key, held, store):
    first, opened, body = held(door, mode="raise_once", name="fails")
    duplicate = InThread(lambda: send(door, key, prefer="wait=5", **body))
    until(waiters(1), "the duplicate to wait")
    opened.set()
    assert first.result().status_code == 500
    own = duplicate.result()
    assert own.status_code == 201, own.content
    assert own["Idempotent-Replay"] == "false"
    assert own.json()["calls"] == 2  # it ran the view: a retry would have
    assert Widget.objects.filter(name="fails").count() == 1
    assert IdempotencyRecord.objects.get(key=key).status == "COMPLETED"


@pytest.mark.parametrize("door", DOORS)
def test_when_the_wait_runs_out_the_duplicate_gets_409(door, key, held, store):
    first, opened, body = held(door, name="slow")
    try:
        refused = send(door, key, prefer="wait=1", **body)
        assert refused.status_code == 409, refused.content
        assert refused.json()["error"] == "transaction_in_progress"
        assert int(refused["Retry-After"]) >= 1
        assert refused["Preference-Applied"] == "wait=1"
    finally:
        opened.set()
    assert first.result().status_code == 201
    assert doors.calls[key] == 1


@pytest.mark.parametrize("door", DOORS)
def test_without_prefer_or_default_a_duplicate_gets_409_at_once(door, key, held, monkeypatch):
    def never(*args: Any) -> bool:
        raise AssertionError("a duplicate that may not wait waited")

    monkeypatch.setattr(attach.Waiter, "wait", never)
    monkeypatch.setattr(attach.Waiter, "wait_async", never)
    first, opened, body = held(door)
    try:
        refused = send(door, key, **body)
        assert refused.status_code == 409
        assert "Preference-Applied" not in refused
    finally:
        opened.set()
    assert first.result().status_code == 201


@pytest.mark.parametrize("door", ["decorator", "mixin"])
def test_a_waiter_with_another_body_gets_422_at_once(door, key, held):
    first, opened, body = held(door, name="one")
    try:
        mismatch = send(door, key, prefer="wait=30", name="another")
        assert mismatch.status_code == 422
        assert attach.waiting() == 0
    finally:
        opened.set()
    assert first.result().status_code == 201


def test_beyond_max_waiters_a_duplicate_gets_409_at_once(key, held, idempotency_settings):
    idempotency_settings(ATTACH_MAX_WAITERS=2, ATTACH_MAX_WAITERS_PER_SCOPE=10)
    first, opened, body = held("decorator", name="crowd")
    attached = [
        InThread(lambda: send("decorator", key, prefer="wait=10", **body)) for _ in range(2)
    ]
    until(waiters(2), "two duplicates to wait")
    try:
        extra = send("decorator", key, prefer="wait=10", **body)
        assert extra.status_code == 409
        assert "Preference-Applied" not in extra
    finally:
        opened.set()
    assert first.result().status_code == 201
    for waiter in attached:
        response = waiter.result()
        assert (response.status_code, response["Idempotent-Replay"]) == (201, "true")


def test_the_waiter_holds_no_transaction_and_no_connection(key, held, monkeypatch):
    seen: list[tuple[bool, bool]] = []
    original = attach.Waiter.wait

    def wait(self: attach.Waiter) -> bool:
        for alias in connections:
            seen.append((connections[alias].in_atomic_block, connections[alias].connection is None))
        return original(self)

    monkeypatch.setattr(attach.Waiter, "wait", wait)
    first, opened, body = held("decorator")
    duplicate = InThread(lambda: send("decorator", key, prefer="wait=5", **body))
    until(waiters(1), "the duplicate to wait")
    opened.set()
    assert first.result().status_code == 201
    assert duplicate.result().status_code == 201
    assert seen and all(not in_atomic and closed for in_atomic, closed in seen)


# --- waking: one statement per tick for every waiter, never one per waiter ----------------------


def test_waiters_are_woken_by_one_shared_poll_and_run_no_queries_while_waiting(
    gate, held, monkeypatch, idempotency_settings
):
    """Completions in another process reach a waiter only through the poller: simulated by
    turning the in-process wake off. Two held keys, three waiters each: every poll names the
    two keys at once, and a waiter's own queries do not grow with its wait."""
    idempotency_settings(ATTACH_POLL_SECONDS=0.05)
    monkeypatch.setattr(attach, "notify", lambda *args: None)
    polls: list[int] = []
    still_running = attach.still_running

    def counted(using: str, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
        polls.append(len(pairs))
        return still_running(using, pairs)

    monkeypatch.setattr(attach, "still_running", counted)
    idempotency_settings(ATTACH_MAX_WAITERS_PER_SCOPE=10)  # one client, six waiters
    # SQLite has one writer: a second request held inside its transaction would lock out the
    # first's claim, so it holds one key there (still three waiters, one name per poll).
    keys = [f"poll-{uuid.uuid4()}" for _ in range(1 if ON_SQLITE else 2)]
    queries: list[int] = []

    def waiting_request(key: str) -> Any:
        with CaptureQueriesContext(connections["default"]) as captured:
            response = send("decorator", key, prefer="wait=20", hold=f"hold-{key}", name=key)
        queries.append(len(captured))
        return response

    firsts, gates = [], []
    for key in keys:
        name = f"hold-{key}"
        started, opened = gate(name)
        firsts.append(
            InThread(lambda key=key, name=name: send("decorator", key, hold=name, name=key))
        )
        assert started.wait(20)
        gates.append(opened)
    duplicates = [InThread(lambda key=key: waiting_request(key)) for key in keys for _ in range(3)]
    until(waiters(3 * len(keys)), "the duplicates to wait")
    polls.clear()
    until(lambda: len(polls) >= 3, "a few polls")
    assert set(polls) == {len(keys)}, polls  # one statement naming each key, not each waiter
    for opened in gates:
        opened.set()
    for first in firsts:
        assert first.result().status_code == 201
    for duplicate in duplicates:
        response = duplicate.result()
        assert (response.status_code, response["Idempotent-Replay"]) == (201, "true")
    # A waiter's claim and its one claim after waking; nothing while it waited.
    assert queries and max(queries) <= 4, queries


def test_the_poller_survives_a_database_error(key, held, monkeypatch, idempotency_settings):
    idempotency_settings(ATTACH_POLL_SECONDS=0.02)
    monkeypatch.setattr(attach, "notify", lambda *args: None)
    failures = []
    still_running = attach.still_running

    def flaky(using: str, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
        if len(failures) < 3:
            failures.append(1)
            raise connections[using].Database.OperationalError("the database went away")
        return still_running(using, pairs)

    monkeypatch.setattr(attach, "still_running", flaky)
    first, opened, body = held("decorator")
    duplicate = InThread(lambda: send("decorator", key, prefer="wait=20", **body))
    until(waiters(1), "the duplicate to wait")
    until(lambda: len(failures) == 3, "three failed polls")
    opened.set()
    assert first.result().status_code == 201
    assert duplicate.result()["Idempotent-Replay"] == "true"


def test_the_poller_stops_and_closes_its_connection_when_nobody_waits(key, held, monkeypatch):
    closed_by: list[str] = []
    close_all = connections.close_all

    def recorded() -> None:
        closed_by.append(threading.current_thread().name)
        close_all()

    monkeypatch.setattr(connections, "close_all", recorded)
    first, opened, body = held("decorator")
    duplicate = InThread(lambda: send("decorator", key, prefer="wait=5", **body))
    until(waiters(1), "the duplicate to wait")
    until(lambda: attach._registry.poller is not None, "the poller")
    poller = attach._registry.poller
    opened.set()
    assert first.result().status_code == 201
    assert duplicate.result().status_code == 201
    poller.join(10)
    assert not poller.is_alive()
    assert "django-idempotency-attach" in closed_by


def test_an_abandoned_waiter_is_forgotten():
    """A waiter registered and never waited on (an async task cancelled in between) leaves no
    lasting place in the registry."""
    from django.test import RequestFactory

    from django_idempotency.core.types import Identity

    identity = Identity("scope", f"abandoned-{uuid.uuid4()}", "f" * 64, "POST", "/")
    waiter = attach.enlist(RequestFactory().post("/"), identity, "default", attach.Patience(0.05))
    assert waiter is not None and attach.waiting() == 1
    until(waiters(0), "the abandoned waiter to be forgotten")


# --- Prefer: wait, malformed, negative or huge ---------------------------------------------------


@pytest.mark.parametrize(
    ("header", "wait"),
    [
        ("wait=5", 5),
        ("WAIT = 7", 7),
        ('wait="3"', 3),
        ("respond-async, wait=2", 2),
        ("return=minimal; foo=bar, Wait=4;x=y", 4),
        ('handling=lenient, foo="a,wait=1", wait=9', 9),
        ("wait=1, wait=8", 1),  # only the first counts
        ("wait=99999999999999999999", 2**31),
        ("wait=" + "9" * 5000, 2**31),
        ("wait=abc", None),
        ("wait=-3", None),
        ("wait=", None),
        ("wait", None),
        ("wait=1.5", None),
        ("wait=٣", None),  # a digit, but not an ASCII one
        ("wait=abc, wait=5", None),
        ("", None),
        (",,,;;;===", None),
        ('"unterminated, wait=5', None),
        ("\x00\xff garbage", None),
    ],
)
def test_prefer_wait_is_parsed_as_rfc_7240_says(header, wait):
    assert attach.prefer_wait(header) == wait


@pytest.mark.parametrize(
    ("prefer", "default", "configured", "expected"),
    [
        (None, None, {}, attach.Patience(0.0)),  # off unless configured
        (None, None, {"ATTACH_DEFAULT_WAIT_SECONDS": 3}, attach.Patience(3.0)),
        (None, 5, {}, attach.Patience(5.0)),  # the view's own default
        (None, 60, {}, attach.Patience(10.0)),  # capped
        (None, float("inf"), {}, attach.Patience(10.0)),
        (None, -1, {}, attach.Patience(0.0)),
        ("wait=4", 2, {}, attach.Patience(4.0, 4)),  # Prefer overrides the default
        ("wait=0", 5, {}, attach.Patience(0.0, 0)),
        ("wait=30", None, {"ATTACH_MAX_WAIT_SECONDS": 2.5}, attach.Patience(2.5, 30)),
        ("wait=abc", 5, {}, attach.Patience(5.0)),  # malformed: as if absent
    ],
)
def test_patience_is_the_prefer_wait_else_the_default_capped(
    prefer, default, configured, expected, idempotency_settings
):
    from django.test import RequestFactory

    idempotency_settings(**configured)
    headers = {} if prefer is None else {"HTTP_PREFER": prefer}
    assert attach.patience(RequestFactory().post("/", **headers), default) == expected


@pytest.mark.parametrize(
    "prefer", ["wait=abc", "wait=-3", "wait=", "wait=1.5", "garbage;;==,", "wait=" + "9" * 5000]
)
def test_a_malformed_prefer_is_ignored_never_a_500(key, held, prefer, idempotency_settings):
    idempotency_settings(ATTACH_MAX_WAIT_SECONDS=0.2)  # a huge wait, capped, costs little here
    first, opened, body = held("decorator")
    try:
        refused = send("decorator", key, prefer=prefer, **body)
        assert refused.status_code == 409, refused.content
    finally:
        opened.set()
    assert first.result().status_code == 201
    assert send("decorator", key, prefer=prefer, **body).status_code == 201  # the replay


def test_a_huge_wait_is_capped(key, held, idempotency_settings):
    idempotency_settings(ATTACH_MAX_WAIT_SECONDS=1)
    first, opened, body = held("decorator")
    try:
        refused = send("decorator", key, prefer="wait=99999999999999999999", **body)
        assert refused.status_code == 409
        assert refused["Preference-Applied"] == "wait=1"
    finally:
        opened.set()
    assert first.result().status_code == 201


# --- under a real ASGI server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def asgi_server(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Any]:
    from tests.support.servers import uvicorn

    with django_db_blocker.unblock(), uvicorn() as running:
        yield running


@pytest.mark.parametrize("door", ["decorator-async", "middleware-async", "middleware", "mixin"])
def test_asgi_duplicate_attaches(door, tmp_path: Path, asgi_server: Any):
    """Under uvicorn: async views, and sync ones behind the middleware (whose ``process_view``
    is async under ASGI), wait on the event loop; the mixin's sync view in its own thread."""
    from tests.request.test_lifecycle_asgi import post

    key = f"asgi-attach-{uuid.uuid4()}"
    hold = tmp_path / "hold"
    hold.touch()
    first = InThread(lambda: post(asgi_server, door, key, name="asgi", hold_file=str(hold)))
    until(lambda: IdempotencyRecord.objects.filter(key=key).exists(), "the first claim")
    duplicate = InThread(
        lambda: asgi_server.request(
            "POST",
            doors.DOORS[door],
            {"name": "asgi", "hold_file": str(hold)},
            headers={"Idempotency-Key": key, "Prefer": "wait=20"},
        )
    )
    # Time for the duplicate to reach the server and wait on the key (it runs in the server's
    # process, where the test cannot see it): one that came after the first request's answer
    # would get a plain replay, without Preference-Applied.
    time.sleep(2)
    hold.unlink()
    status, headers, body = first.result()
    assert status == 201, body
    status, headers, content = duplicate.result()
    assert status == 201, content
    assert headers["Idempotent-Replay"] == "true"
    assert json.loads(content) == body
    assert headers["Preference-Applied"] == "wait=10"  # capped at the default maximum
    assert Widget.objects.filter(name="asgi").count() == 1


# --- a duplicate that may wait meets the checks a new request meets ------------------------------

#: The DRF doors: the mixin claims before DRF's checks, and the middleware before the view runs.
DRF_DOORS = ["middleware-drf", "api-function", "mixin"]


def send_with(door: str, key: str, headers: dict[str, str], **body: Any) -> Any:
    try:
        return Client(raise_request_exception=False).post(
            doors.DOORS[door], json.dumps(body), content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=key, **headers,
        )  # fmt: skip
    finally:
        connection.close()


@pytest.fixture
def held_with(
    gate: Any, key: str
) -> Callable[..., tuple[InThread, threading.Event, dict[str, Any]]]:
    """:func:`held`, with the first request's own headers."""

    def start(
        door: str, headers: dict[str, str], **body: Any
    ) -> tuple[InThread, threading.Event, dict[str, Any]]:
        body["hold"] = f"hold-{uuid.uuid4().hex[:8]}"
        started, opened = gate(body["hold"])
        first = InThread(lambda: send_with(door, key, headers, **body))
        assert started.wait(20), "the first request never reached its view"
        return first, opened, body

    return start


@pytest.mark.parametrize("door", DRF_DOORS)
def test_a_throttled_duplicate_is_refused_at_once_never_waits(door, key, held_with):
    """The first request used the key's one allowance: a duplicate asking to wait is a 429 at
    once, holding no thread (before, it waited its full time and met no throttle)."""
    throttled = {"HTTP_X_THROTTLE": "1"}
    first, opened, body = held_with(door, throttled)
    try:
        duplicate = send_with(door, key, {**throttled, "HTTP_PREFER": "wait=10"}, **body)
        assert duplicate.status_code == 429, duplicate.content
        assert attach.waiting() == 0
    finally:
        opened.set()
    assert first.result().status_code == 201
    assert doors.calls[key] == 1


@pytest.mark.parametrize("door", DRF_DOORS)
def test_a_duplicate_its_permissions_refuse_is_refused_at_once_never_waits(door, key, held_with):
    first, opened, body = held_with(door, {})
    try:
        denied = {"HTTP_X_DENY": "yes", "HTTP_PREFER": "wait=10"}
        duplicate = send_with(door, key, denied, **body)
        assert duplicate.status_code in (401, 403), duplicate.content  # 401 to an anonymous one
        assert attach.waiting() == 0
    finally:
        opened.set()
    assert first.result().status_code == 201
    new = send_with(door, f"{key}-new", denied, **body)  # a new request is refused the same
    assert (duplicate.status_code, duplicate.content) == (new.status_code, new.content)


@pytest.mark.parametrize("door", DRF_DOORS)
def test_a_wait_counts_against_the_throttle(door, key, held_with):
    """Two requests an hour: the first, then a duplicate that waits; a third is a 429."""
    twice = {"HTTP_X_THROTTLE": "2"}
    first, opened, body = held_with(door, twice)
    waiting = InThread(lambda: send_with(door, key, {**twice, "HTTP_PREFER": "wait=10"}, **body))
    try:
        until(waiters(1), "the duplicate to wait")
        third = send_with(door, key, {**twice, "HTTP_PREFER": "wait=10"}, **body)
        assert third.status_code == 429, third.content
    finally:
        opened.set()
    assert first.result().status_code == 201
    attached = waiting.result()
    assert (attached.status_code, attached["Idempotent-Replay"]) == (201, "true")


def test_waiters_are_bounded_per_scope(key, held, idempotency_settings):
    """One client (the anonymous scope here) holds at most ATTACH_MAX_WAITERS_PER_SCOPE waiting
    duplicates in a process; past it, a duplicate is a 409 at once, though the process bound
    (ATTACH_MAX_WAITERS) has room."""
    idempotency_settings(ATTACH_MAX_WAITERS_PER_SCOPE=1, ATTACH_MAX_WAITERS=100)
    first, opened, body = held("decorator")
    try:
        waiting = InThread(lambda: send("decorator", key, prefer="wait=10", **body))
        until(waiters(1), "the first duplicate to wait")
        refused = send("decorator", key, prefer="wait=10", **body)
        assert refused.status_code == 409, refused.content
        assert attach.waiting() == 1
    finally:
        opened.set()
    assert first.result().status_code == 201
    assert waiting.result().status_code == 201


def test_the_per_scope_bound_leaves_other_scopes_room():
    registry = attach._Registry()
    mine = [attach.Waiter("default", "user:1", f"k{n}", time.monotonic() + 5) for n in range(3)]
    theirs = attach.Waiter("default", "user:2", "k0", time.monotonic() + 5)
    try:
        assert [registry.add(w, limit=10, per_scope=2) for w in mine] == [True, True, False]
        assert registry.add(theirs, limit=10, per_scope=2)
        registry.remove(mine[0])
        assert registry.add(mine[2], limit=10, per_scope=2)  # a place of its own scope freed
        assert registry.by_scope == {"user:1": 2, "user:2": 1}
    finally:
        for waiter in [*mine, theirs]:
            registry.remove(waiter)
    assert registry.by_scope == {} and registry.count == 0
