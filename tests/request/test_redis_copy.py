"""The Redis copy of completed responses against the real local Redis and a local Redis Cluster
(and a private Redis for outages). Redis only ever answers replays; every other answer, 409
included, is the database's, so nothing Redis does can refuse a retry or replay a response the
database does not hold. tests/request/test_redis_cluster.py fails the cluster over under load."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.db import close_old_connections, connections
from django.http import HttpResponse
from django_redis import get_redis_connection
from rest_framework.response import Response
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.core.types import Decision, Identity, Mismatch, Proceed, Replay
from django_idempotency.exceptions import LeaseLostConflict
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import lifecycle, redis_copy
from tests.support.ports import free_port
from tests.testapp.models import Widget
from tests.testapp.views import WidgetAPIView

pytestmark = pytest.mark.django_db(transaction=True)

ALIAS = "idempotency-fast"


CLUSTER_FACTORY = "django_idempotency.request.redis_cluster.ClusterConnectionFactory"


def configure(settings: Any, location: str, *, cluster: bool = False, **idempotency: Any) -> str:
    """Point the Redis copy at ``location`` under a fresh key prefix; returns the prefix."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    options: dict[str, Any] = {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 2}
    if cluster:
        options["CONNECTION_FACTORY"] = CLUSTER_FACTORY
    settings.CACHES = {
        **settings.CACHES,
        ALIAS: {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": location,
            "KEY_PREFIX": prefix,
            "OPTIONS": options,
        },
    }
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "CACHE_ALIAS": ALIAS, **idempotency}
    return prefix


@pytest.fixture(params=["standalone", "cluster"])
def redis(request: Any, settings: Any) -> Iterator[Any]:
    """The Redis copy on the shared Redis, then on the Redis Cluster: every test that takes this
    fixture runs on both."""
    if request.param == "cluster":
        prefix = configure(settings, request.getfixturevalue("redis_cluster").url, cluster=True)
    else:
        prefix = configure(settings, request.getfixturevalue("redis_url"))
    client = get_redis_connection(ALIAS)
    yield client
    for name in client.scan_iter(f"{prefix}:*"):
        client.delete(name)


@pytest.fixture
def failures() -> Iterator[list[dict[str, Any]]]:
    received: list[dict[str, Any]] = []

    def record(sender: Any, **kwargs: Any) -> None:
        received.append(kwargs)

    signals.redis_copy_failed.connect(record)
    yield received
    signals.redis_copy_failed.disconnect(record)


def post(client: APIClient, key: str, name: str = "a", **extra: Any) -> Any:
    return client.post(
        "/api/widget/", {"name": name, **extra}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )


def entry(redis: Any, scope: str, key: str) -> bytes | None:
    value: bytes | None = redis.get(redis_copy.redis_key(scope, key))
    return value


def identity(key: str, scope: str = "tenant", fingerprint: str = "f" * 64) -> Identity:
    return Identity(scope=scope, key=key, fingerprint=fingerprint, method="POST", path="/x")


def run_to_completion(decision: Decision, body: bytes = b"done") -> None:
    assert isinstance(decision, Proceed), decision
    lifecycle.run(decision.lease, lambda: HttpResponse(body, status=201))


def complete_and_retry(retried: Identity) -> None:
    """Complete a key, then replay it once from the database, which copies it to Redis."""
    run_to_completion(lifecycle.claim(retried))
    assert isinstance(lifecycle.claim(retried), Replay)


# --- replays without the database ---------------------------------------------------------------


def test_replay_is_served_from_redis_without_a_query(redis, client, key, django_assert_num_queries):
    first = post(client, key)
    assert first.status_code == 201, first.content
    # Copied at the first replay, not at the completion: a key never retried costs Redis nothing.
    assert entry(redis, "anonymous", key) is None
    with django_assert_num_queries(1):  # the first replay: the database, then the copy
        second = post(client, key)
    assert entry(redis, "anonymous", key).startswith(b"C")
    with django_assert_num_queries(0):
        third = post(client, key)
    for replay in (second, third):
        assert replay.status_code == 201
        assert replay["Idempotent-Replay"] == "true"
        assert replay.content == first.content
        assert replay["Location"] == first["Location"]
    assert Widget.objects.count() == 1


def recorded_commands(monkeypatch: Any) -> list[str]:
    """The names of the Redis commands this thread sends from now on (on the client it sends
    them with: its own connection, on standalone Redis)."""
    sent: list[str] = []
    sender = redis_copy._client()
    send = sender.execute_command

    def recording(*args: Any, **options: Any) -> Any:
        sent.append(str(args[0]))
        return send(*args, **options)

    monkeypatch.setattr(sender, "execute_command", recording)
    return sent


def test_one_redis_command_before_the_view_and_none_after_it(redis, client, key, monkeypatch):
    """First time: a GET, then nothing after the commit. The first replay: a GET, the database's
    answer, then the copy (SET). Every later replay: a GET."""
    sent = recorded_commands(monkeypatch)
    assert post(client, key)["Idempotent-Replay"] == "false"
    assert sent == ["GET"]
    for commands in (["GET", "SET"], ["GET"], ["GET"]):
        sent.clear()
        assert post(client, key)["Idempotent-Replay"] == "true"
        assert sent == commands


def test_on_new_keys_only_the_copy_is_not_read_and_it_is_read_again_when_retries_come_back(
    redis, client, key, monkeypatch, django_assert_num_queries
):
    """A read that misses pays a round trip for nothing: a process whose claims are nearly all
    new keys goes to the database at once. Replays, the database's included, bring the reads
    back, and the copy then answers without a query."""
    sent = recorded_commands(monkeypatch)
    completed = [identity(f"{key}-{number}") for number in range(100)]
    for new in completed:
        run_to_completion(lifecycle.claim(new))
    assert sent.count("GET") < 100  # the first claims read it, the later ones no longer do
    sent.clear()
    assert post(client, key)["Idempotent-Replay"] == "false"
    assert sent == []  # first time: the database's claim alone, no GET that would miss
    replays_before_reading = 0
    for retried in completed:
        sent.clear()
        assert isinstance(lifecycle.claim(retried), Replay)
        if "GET" in sent:
            break
        assert sent == ["SET"]  # answered by the database, and copied for the next retry
        replays_before_reading += 1
    assert 0 < replays_before_reading <= 10
    for retried in completed[:replays_before_reading]:
        with django_assert_num_queries(0):
            assert isinstance(lifecycle.claim(retried), Replay)
    assert post(client, key)["Idempotent-Replay"] == "true"


def test_control_a_process_that_starts_reading_reads_for_its_first_claims(redis, monkeypatch):
    """Without the claims before it, a new key's claim reads the copy (the test above proves
    the reads stop because of those claims, not for some other reason)."""
    sent = recorded_commands(monkeypatch)
    for number in range(5):
        run_to_completion(lifecycle.claim(identity(f"fresh-{number}-{uuid.uuid4()}")))
    assert sent == ["GET"] * 5


def test_copy_expires_no_later_than_the_record(redis, key):
    complete_and_retry(identity(key))
    copy_ms = redis.pttl(redis_copy.redis_key("tenant", key))
    record = IdempotencyRecord.objects.get(key=key)
    assert 0 < copy_ms <= 86_400_000
    ttl = (record.expires_at - record.completed_at).total_seconds()
    assert copy_ms / 1000 <= ttl


def test_nothing_is_in_redis_while_a_request_runs(redis, client, key, gate):
    """No in-flight marker: a duplicate's 409 is always the database's answer."""
    started, release = gate("held-fast")
    results: list[Any] = []

    def first_request() -> None:
        try:
            results.append(post(APIClient(), key, name="held-fast"))
        finally:
            connections.close_all()

    thread = threading.Thread(target=first_request)
    thread.start()
    try:
        assert started.wait(30)
        assert entry(redis, "anonymous", key) is None
        duplicate = post(client, key, name="held-fast")
        assert duplicate.status_code == 409, duplicate.content
        assert duplicate.json()["error"] == "transaction_in_progress"
        assert 1 <= int(duplicate["Retry-After"]) <= 30
    finally:
        release.set()
        thread.join(30)
    assert results[0].status_code == 201
    assert Widget.objects.filter(name="held-fast").count() == 1
    replay = post(client, key, name="held-fast")
    assert replay["Idempotent-Replay"] == "true"


# --- never another request's response -----------------------------------------------------------


def test_replay_never_crosses_scopes(redis, key):
    run_to_completion(lifecycle.claim(identity(key, scope="tenant-a")), body=b"for a")
    other = lifecycle.claim(identity(key, scope="tenant-b"))
    assert isinstance(other, Proceed)
    run_to_completion(other, body=b"for b")
    replay_a = lifecycle.claim(identity(key, scope="tenant-a"))
    assert isinstance(replay_a, Replay)
    assert replay_a.response.body == b"for a"


def test_scope_and_key_cannot_collide_in_the_redis_name():
    assert redis_copy.redis_key("a:b", "c") != redis_copy.redis_key("a", "b:c")


def test_one_scopes_copies_are_found_by_the_scope_digest(redis, key):
    """How an operator finds every copy of one scope (docs/redis.md): ``SCAN`` on its digest."""
    for scope, suffix in [("tenant-a", "1"), ("tenant-a", "2"), ("tenant-b", "1")]:
        complete_and_retry(identity(f"{key}-{suffix}", scope=scope))
    digest = redis_copy.hash_tag("tenant-a", "").partition(":")[0]
    found = {name.decode() for name in redis.scan_iter(f"*idem:{{{digest}:*}}:{key}-*")}
    assert found == {redis_copy.redis_key("tenant-a", f"{key}-{n}") for n in (1, 2)}


def test_other_fingerprint_is_refused_by_the_database_not_replayed(redis, client, key):
    assert post(client, key, name="a").status_code == 201
    other = post(client, key, name="b")
    assert other.status_code == 422
    assert other.json()["error"] == "payload_mismatch"


def test_in_flight_with_other_fingerprint_asks_the_database(redis, key):
    lifecycle.claim(identity(key))
    decision = lifecycle.claim(identity(key, fingerprint="0" * 64))
    assert isinstance(decision, Mismatch)


def test_missing_redis_entry_falls_back_to_the_database(
    redis, client, key, django_assert_max_num_queries
):
    first = post(client, key)
    redis.delete(redis_copy.redis_key("anonymous", key))
    with django_assert_max_num_queries(2):
        second = post(client, key)
    assert second["Idempotent-Replay"] == "true"
    assert second.content == first.content


def test_unreadable_entry_falls_back_to_the_database(redis, client, key):
    first = post(client, key)
    redis.set(redis_copy.redis_key("anonymous", key), b"C{not json\nbody")
    second = post(client, key)
    assert second["Idempotent-Replay"] == "true"
    assert second.content == first.content


# --- releases -----------------------------------------------------------------------------------


def test_failed_request_leaves_nothing_in_redis_and_a_retry_runs_at_once(redis, client, key):
    failed = post(client, key, name="a", status=500)
    assert failed.status_code == 500
    assert entry(redis, "anonymous", key) is None
    retry = post(client, key, name="a")
    assert retry.status_code == 201
    assert Widget.objects.count() == 1  # the failed request's write rolled back


def test_admin_release_removes_the_stale_redis_copy(redis, client, key):
    assert post(client, key, name="a").status_code == 201
    assert post(client, key, name="a")["Idempotent-Replay"] == "true"  # copied to Redis
    assert entry(redis, "anonymous", key) is not None
    # What the admin's release action does: delete the rows, then announce it.
    IdempotencyRecord.objects.filter(scope="anonymous", key=key).delete()
    signals.key_released.send(sender=IdempotencyRecord, scope="anonymous", key=key, reason="admin")
    assert entry(redis, "anonymous", key) is None
    again = post(client, key, name="a")
    assert again.status_code == 201
    assert again["Idempotent-Replay"] == "false"
    assert Widget.objects.count() == 2


def test_rolled_back_completion_is_never_copied(redis, key):
    decision = lifecycle.claim(identity(key))
    assert isinstance(decision, Proceed)

    def view() -> HttpResponse:
        # Another request took the key over meanwhile: the completion must roll back.
        IdempotencyRecord.objects.filter(key=key).update(owner_token=uuid.uuid4())
        return HttpResponse(b"lost", status=201)

    with pytest.raises(LeaseLostConflict):
        lifecycle.run(decision.lease, view)
    assert entry(redis, "tenant", key) is None


# --- Redis failures -----------------------------------------------------------------------------


@contextlib.contextmanager
def redis_copy_disabled() -> Iterator[None]:
    from django.conf import settings
    from django.test import override_settings

    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "CACHE_ALIAS": None}):
        yield


class PrivateRedis:
    """A redis-server of our own, on a free port, that a test may stop and start."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)
            self.process = None


@pytest.fixture
def private_redis(settings: Any) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis()
    server.start()
    configure(settings, server.url)
    yield server
    server.stop()


def test_redis_stopped_and_restarted_between_requests(
    private_redis, client, failures, django_assert_num_queries, idempotency_settings
):
    idempotency_settings(CACHE_RETRY_SECONDS=0)  # try Redis on every request: no resting
    first = post(client, "before")
    assert first.status_code == 201
    assert post(client, "before")["Idempotent-Replay"] == "true"  # from the database, copied
    with django_assert_num_queries(0):
        assert post(client, "before")["Idempotent-Replay"] == "true"

    private_redis.stop()
    replay = post(client, "before")
    assert replay.status_code == 201
    assert replay["Idempotent-Replay"] == "true"
    assert replay.content == first.content
    fresh = post(client, "during")
    assert fresh.status_code == 201
    assert post(client, "during")["Idempotent-Replay"] == "true"
    assert {failure["operation"] for failure in failures} >= {"lookup", "remember"}
    assert all(isinstance(failure["error"], Exception) for failure in failures)

    private_redis.start()
    assert post(client, "after").status_code == 201
    assert post(client, "after")["Idempotent-Replay"] == "true"
    with django_assert_num_queries(0):
        assert post(client, "after")["Idempotent-Replay"] == "true"
    assert Widget.objects.count() == 3


@pytest.mark.concurrency
def test_redis_stopped_in_the_middle_of_a_concurrent_run(private_redis):
    keys = [f"run-{uuid.uuid4()}" for _ in range(40)]
    answered = threading.Semaphore(0)
    statuses: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def worker(chunk: list[str]) -> None:
        api = APIClient()
        try:
            for key in chunk:
                for _ in range(2):  # the request and its retry
                    response = post(api, key, name=key)
                    with lock:
                        statuses.append((key, response.status_code, response["Idempotent-Replay"]))
                    answered.release()
        finally:
            close_old_connections()
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(keys[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(20):  # a quarter of the requests answered: pull Redis away
        assert answered.acquire(timeout=60)
    private_redis.stop()
    for thread in threads:
        thread.join(120)
    assert len(statuses) == 2 * len(keys)
    assert {status for _, status, _ in statuses} == {201}
    for key in keys:
        assert Widget.objects.filter(name=key).count() == 1
        assert sorted(replay for k, _, replay in statuses if k == key) == ["false", "true"]


class StoppedClock:
    """The ``time`` module as ``redis_copy`` sees it, but for a monotonic clock that stands
    still until the test moves it: how long the process rests is then measured against
    moments the test chooses, not against how fast the machine answers requests."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_after_a_redis_error_the_process_rests_then_tries_redis_again(
    private_redis, client, failures, django_assert_num_queries, idempotency_settings, monkeypatch
):
    pause = 3.0
    idempotency_settings(CACHE_RETRY_SECONDS=pause)
    clock = StoppedClock()
    monkeypatch.setattr(redis_copy, "time", clock)
    private_redis.stop()
    failed_at = clock.now
    assert post(client, "first").status_code == 201
    assert [failure["operation"] for failure in failures] == ["lookup"]
    # Resting: the replay's copy and every later request leave Redis alone.
    assert post(client, "second").status_code == 201
    assert post(client, "second")["Idempotent-Replay"] == "true"
    assert [failure["operation"] for failure in failures] == ["lookup"]
    # Still resting just before the pause ends: a replay's copy would fail on the stopped
    # Redis, and be reported.
    clock.now = failed_at + pause - 0.01
    assert post(client, "second")["Idempotent-Replay"] == "true"
    assert [failure["operation"] for failure in failures] == ["lookup"]

    private_redis.start()
    clock.now = failed_at + pause + 0.01
    assert post(client, "third").status_code == 201
    assert post(client, "third")["Idempotent-Replay"] == "true"
    with django_assert_num_queries(0):
        assert post(client, "third")["Idempotent-Replay"] == "true"
    assert len(failures) == 1


def test_a_released_key_copy_is_deleted_even_while_resting(
    private_redis, failures, key, idempotency_settings
):
    idempotency_settings(CACHE_RETRY_SECONDS=60)
    private_redis.stop()
    assert redis_copy.lookup(identity(key)) is None
    private_redis.start()
    client = get_redis_connection(ALIAS)
    client.set(redis_copy.redis_key("s", key), b"stale copy")
    signals.key_released.send(sender=IdempotencyRecord, scope="s", key=key, reason="admin")
    assert client.get(redis_copy.redis_key("s", key)) is None
    assert [failure["operation"] for failure in failures] == ["lookup"]


def test_failed_forget_is_reported_loudly(private_redis, failures, key):
    private_redis.stop()
    signals.key_released.send(sender=IdempotencyRecord, scope="s", key=key, reason="admin")
    assert [failure["operation"] for failure in failures] == ["forget"]


# --- the connection each thread keeps -----------------------------------------------------------


def held_connection() -> Any:
    client = redis_copy._client()
    return client, client.connection


def test_a_thread_keeps_one_connection_of_the_caches_pool(settings, redis_url, key):
    configure(settings, redis_url)
    client, connection = held_connection()
    for _ in range(3):
        assert redis_copy.lookup(identity(key)) is None
    assert held_connection() == (client, connection)
    # The cache's own connection settings: the pool is the cache's.
    assert client.connection_pool is get_redis_connection(ALIAS).connection_pool


def test_a_thread_asks_django_for_the_cache_and_its_client_once(
    settings, redis_url, key, monkeypatch
):
    """Asking for them on every command cost as much CPU as the rest of a GET's Python side."""
    configure(settings, redis_url)
    import django_redis

    asked: list[str] = []
    real = django_redis.get_redis_connection

    def counted(alias: str = "default", write: bool = True) -> Any:
        asked.append(alias)
        return real(alias, write)

    monkeypatch.setattr(django_redis, "get_redis_connection", counted)
    for _ in range(3):
        assert redis_copy.lookup(identity(key)) is None
    assert asked == [ALIAS]
    # A settings change (another KEY_PREFIX, here) is looked up afresh.
    prefix = configure(settings, redis_url)
    assert redis_copy.lookup(identity(key)) is None
    assert asked == [ALIAS, ALIAS]
    assert redis_copy.redis_key("s", "k").startswith(prefix)


def test_each_thread_has_a_connection_of_its_own(settings, redis_url, key):
    configure(settings, redis_url)
    mine = held_connection()
    theirs: list[Any] = []
    thread = threading.Thread(target=lambda: theirs.append(held_connection()))
    thread.start()
    thread.join(30)
    assert theirs and theirs[0][0] is not mine[0]
    assert theirs[0][1] is not mine[1]


def test_a_forked_process_or_another_redis_takes_a_new_connection(
    settings, redis_url, key, monkeypatch
):
    configure(settings, redis_url)
    before, _ = held_connection()
    monkeypatch.setattr(os, "getpid", lambda: -1)  # what a child of a fork sees: another pid
    after_fork, _ = held_connection()
    assert after_fork is not before
    # Another Redis (database 3): django-redis gives the cache a pool of its own.
    configure(settings, urlsplit(redis_url)._replace(path="/3").geturl())
    assert held_connection()[0] is not after_fork
    assert redis_copy.lookup(identity(key)) is None


def test_a_cluster_client_is_used_as_the_cache_gives_it(settings, redis_cluster):
    configure(settings, redis_cluster.url, cluster=True)
    assert redis_copy._client() is get_redis_connection(ALIAS)


@pytest.mark.concurrency
def test_concurrent_duplicates_run_once_with_the_redis_copy(redis, key):
    barrier = threading.Barrier(6)
    statuses: list[int] = []

    def request() -> None:
        try:
            barrier.wait(30)
            statuses.append(post(APIClient(), key, name="race").status_code)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=request) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(statuses) == 6
    assert set(statuses) <= {201, 409}
    assert Widget.objects.filter(name="race").count() == 1


# --- a Redis error never outvotes the database (issue: a retry after a 500 refused for a lease) --


@pytest.mark.parametrize("fault", ["stopped", "restarted", "slow"])
def test_a_retry_after_a_500_runs_at_once_whatever_redis_did(
    private_redis, client, key, failures, fault, idempotency_settings, monkeypatch
):
    """The first request fails with a 500 while Redis fails under it; the same request sent
    again must run at once, never get a 409 from anything Redis kept."""
    idempotency_settings(CACHE_RETRY_SECONDS=60)  # rest for the whole test after an error

    def failing_view(self: Any, request: Any) -> Any:
        assert private_redis.process is not None
        if fault == "slow":
            # A Redis that stops answering (SIGSTOP) and keeps its data: every call until it
            # wakes times out after the socket timeout.
            os.kill(private_redis.process.pid, signal.SIGSTOP)
        else:
            private_redis.stop()
            if fault == "restarted":
                private_redis.start()
        return Response({"error": "upstream failed"}, status=500)

    monkeypatch.setattr(WidgetAPIView, "post", failing_view)
    try:
        failed = post(client, key, name="a")
    finally:
        if fault == "slow" and private_redis.process is not None:
            os.kill(private_redis.process.pid, signal.SIGCONT)
    assert failed.status_code == 500
    monkeypatch.undo()
    if private_redis.process is None:
        private_redis.start()
    redis_copy._resting_until.clear()  # Redis answers again and the process uses it at once
    retry = post(client, key, name="a")
    assert retry.status_code == 201, retry.content
    assert retry["Idempotent-Replay"] == "false"
    assert Widget.objects.filter(name="a").count() == 1
    assert post(client, key, name="a")["Idempotent-Replay"] == "true"


def test_the_redis_copy_adds_no_database_statement_to_a_first_request(
    redis, client, key, django_assert_num_queries
):
    from tests.db.test_round_trips import BEGIN_COMMIT, COMPLETION, FIRST_CLAIM

    vendor = connections["default"].vendor
    with django_assert_num_queries(FIRST_CLAIM[vendor] + BEGIN_COMMIT + 1 + COMPLETION[vendor]):
        assert post(client, key).status_code == 201
