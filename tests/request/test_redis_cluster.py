"""The Redis copy on Redis Cluster: names hash-tagged per record, the connection factory, and a
master failing over under concurrent requests. tests/request/test_redis_copy.py runs the rest of the
Redis copy's tests on the cluster too (its ``redis`` fixture)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import close_old_connections, connections
from django_redis import get_redis_connection
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, ResponseError
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.request import redis_copy
from django_idempotency.request.redis_cluster import ClusterConnectionFactory
from tests.request.test_redis_copy import ALIAS, configure, post
from tests.support.redis_cluster import LocalRedisCluster, Node
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def on_cluster(redis_cluster: Any, settings: Any) -> Iterator[Any]:
    """The Redis copy on the cluster, under a fresh key prefix; yields the raw cluster client."""
    prefix = configure(settings, redis_cluster.url, cluster=True, CACHE_RETRY_SECONDS=0.5)
    client = get_redis_connection(ALIAS)
    yield client
    for name in client.scan_iter(f"{prefix}:*"):
        client.delete(name)


# --- hash tags ----------------------------------------------------------------------------------


def tag_of(name: str) -> str:
    """What Redis Cluster hashes: the text between the first ``{`` and the ``}`` after it."""
    start = name.index("{")
    return name[start + 1 : name.index("}", start)]


@pytest.mark.parametrize(
    ("scope", "key"),
    [("tenant", "k-1"), ("user:{7}", "a}b{c"), ("{", "}"), ("", "{x}"), ("é", "{}")],
)
def test_every_name_of_a_record_hashes_to_its_tag(settings: Any, scope: str, key: str) -> None:
    """Braces a client puts in its key (or a resolver in a scope) never move the slot: the tag
    comes first and holds digests only."""
    configure(settings, "redis://127.0.0.1:1/0", cluster=True)
    name = redis_copy.redis_key(scope, key)
    assert tag_of(name) == redis_copy.hash_tag(scope, key)
    sibling = f"{name[: name.index('}') + 1]}:lock"  # a name a future script might add
    assert key_slot(name.encode()) == key_slot(sibling.encode())
    assert name.endswith(f":{key}")


def test_records_spread_over_the_slots(settings: Any) -> None:
    configure(settings, "redis://127.0.0.1:1/0", cluster=True)
    slots = {key_slot(redis_copy.redis_key("one-tenant", f"key-{n}").encode()) for n in range(300)}
    assert len(slots) > 280  # one tenant's keys are not piled on one node


def test_a_script_over_one_records_names_runs_on_the_cluster(on_cluster: Any) -> None:
    """What the tags buy: a Lua script over two names of one record is legal on the cluster,
    over two records it is refused (by redis-py before the server would)."""
    one, sibling = redis_copy.redis_key("s", "k"), f"{redis_copy.redis_key('s', 'k')}:lock"
    other = redis_copy.redis_key("s", "another key")
    assert key_slot(one.encode()) != key_slot(other.encode())
    script = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('SET', KEYS[2], ARGV[1])"
    assert on_cluster.eval(script, 2, one, sibling, "v")
    assert on_cluster.get(sibling) == b"v"
    with pytest.raises((ResponseError, RedisClusterException), match="same key slot|CROSSSLOT"):
        on_cluster.eval(script, 2, one, other, "v")
    on_cluster.delete(sibling)


# --- the connection factory ---------------------------------------------------------------------


def test_one_cluster_client_per_process_and_location(on_cluster: Any) -> None:
    """Django makes a cache object per thread; they must all share one cluster client (each
    new one would fetch the slot map again)."""
    seen: list[Any] = []

    def other_thread() -> None:
        seen.append(get_redis_connection(ALIAS))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(30)
    assert seen == [on_cluster]
    assert type(on_cluster).__name__ == "RedisCluster"


def test_a_disconnected_client_reconnects(on_cluster: Any, redis_cluster: Any) -> None:
    factory = ClusterConnectionFactory({"SOCKET_TIMEOUT": 2})
    client = factory.connect(redis_cluster.url)
    client.set("di-test-reconnect", b"1")
    factory.disconnect(client)
    assert client.get("di-test-reconnect") == b"1"
    client.delete("di-test-reconnect")


def answered_from_the_database(key: str) -> list[tuple[str, str]]:
    """A request and its retry, both answered (the retry replayed) with one effect; the Redis
    copy's failures they met, as (operation, error class)."""
    failures: list[tuple[str, str]] = []

    def record(sender: Any, operation: str, error: BaseException, **kwargs: Any) -> None:
        failures.append((operation, type(error).__name__))

    signals.redis_copy_failed.connect(record)
    try:
        first, retry = post(APIClient(), key), post(APIClient(), key)
    finally:
        signals.redis_copy_failed.disconnect(record)
    assert (first.status_code, retry.status_code) == (201, 201)
    assert retry["Idempotent-Replay"] == "true"
    assert Widget.objects.count() == 1
    return failures


def test_an_unreachable_cluster_falls_back_to_the_database(settings: Any, key: str) -> None:
    """redis-py's cluster client raises ``RedisClusterException``, which is no ``RedisError``,
    when no node answers: it must be taken for a Redis failure, not become a 500."""
    configure(settings, "redis://127.0.0.1:1/0", cluster=True, CACHE_RETRY_SECONDS=0)
    failures = answered_from_the_database(key)
    # The retry's look-up fails, the database replays it, and its copy to Redis fails too.
    assert [operation for operation, _ in failures[:3]] == ["lookup", "lookup", "remember"]


def test_a_client_that_fails_its_refresh_of_the_nodes_falls_back_to_the_database(
    settings: Any, key: str, monkeypatch: Any
) -> None:
    """In the seconds of a failover, threads that refresh redis-py's cluster table of nodes at
    once make it raise ``RuntimeError``: a Redis failure too, never a 500."""
    configure(settings, "redis://127.0.0.1:1/0", cluster=True, CACHE_RETRY_SECONDS=0)

    class Refreshing:
        def get(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("dictionary keys changed during iteration")

        set = get

    monkeypatch.setattr(redis_copy, "_client", Refreshing)
    failures = answered_from_the_database(key)
    assert failures[:3] == [(step, "RuntimeError") for step in ("lookup", "lookup", "remember")]


# --- failover under load ------------------------------------------------------------------------


@dataclass
class Run:
    """Requests sent by pairs of threads that share their keys (so every key also meets a
    concurrent duplicate), each key sent by both, then retried by both."""

    answers: list[tuple[str, str, int, str, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    keys: dict[int, list[str]] = field(default_factory=dict)

    def answered(self) -> int:
        with self.lock:
            return len(self.answers)

    def worker(self, pair: int) -> None:
        api = APIClient()
        try:
            for n in range(10_000):
                if self.stop.is_set():
                    return
                key = f"failover-{pair}-{n}"
                with self.lock:
                    if len(self.keys.setdefault(pair, [])) <= n:
                        self.keys[pair].append(key)
                for kind in ("first", "retry"):
                    started = time.monotonic()
                    response = post(api, key, name=key)
                    with self.lock:
                        self.answers.append((key, kind, response.status_code,
                                             response.get("Idempotent-Replay", ""),
                                             started, time.monotonic()))  # fmt: skip
        finally:
            close_old_connections()
            connections.close_all()


def fail_over(cluster: LocalRedisCluster, master: Node, how: str) -> Node:
    """Fail ``master`` over to its replica; returns the replica once it serves the slots."""
    replica = cluster.replica_of(master)
    if how == "killed":
        master.kill()
    else:  # the replica asks its master to hand over, as an operator's maintenance would
        with replica.client() as client:
            client.execute_command("CLUSTER", "FAILOVER")
    cluster.wait_for_master(replica)
    return replica


@pytest.mark.concurrency
@pytest.mark.parametrize("how", ["killed", "handed-over"])
def test_a_master_fails_over_under_concurrent_requests(
    on_cluster: Any, redis_cluster: Any, how: str, django_assert_num_queries: Any
) -> None:
    """A master is killed (SIGKILL) or hands over to its replica while four threads send
    requests and retries. Every request is answered as without Redis (201, a replay, or a
    409 for the concurrent duplicate), each key's effect happens once, and once the new master
    serves its slots the Redis copy replays from it again without a query."""
    cluster = redis_cluster.local
    if cluster is None:
        pytest.skip("REDIS_CLUSTER_URL's cluster is not ours to fail over")
    failures: list[str] = []

    def record(sender: Any, operation: str, **kwargs: Any) -> None:
        failures.append(operation)

    victim = cluster.master_of(redis_copy.redis_key("anonymous", "failover-0-0"))
    run = Run()
    threads = [threading.Thread(target=run.worker, args=(n // 2,)) for n in range(4)]
    signals.redis_copy_failed.connect(record)
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while run.answered() < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        began = time.monotonic()
        promoted = fail_over(cluster, victim, how)
        ended = time.monotonic()
        time.sleep(1.0)  # past CACHE_RETRY_SECONDS: the threads use Redis again
        run.stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        run.stop.set()
        signals.redis_copy_failed.disconnect(record)
        if how == "killed":
            victim.start()  # it rejoins as the new master's replica, for the next test
        cluster.wait_healthy()

    statuses = Counter(status for _, _, status, _, _, _ in run.answers)
    during = [a for a in run.answers if a[4] < ended and a[5] > began]
    print(  # the figures for docs/redis.md
        f"\n{how}: failover took {ended - began:.2f} s; {len(run.answers)} requests, "
        f"{len(during)} while it ran; statuses {dict(statuses)}; {len(failures)} Redis errors "
        f"absorbed ({dict(Counter(failures))}); slowest request "
        f"{max(a[5] - a[4] for a in run.answers) * 1000:.0f} ms"
    )
    assert during, "no request overlapped the failover"
    assert set(statuses) <= {201, 409}, statuses
    for key in (k for keys in run.keys.values() for k in keys):
        answers = [a for a in run.answers if a[0] == key]
        assert Widget.objects.filter(name=key).count() == (1 if answers else 0), key
        completed = min((a[5] for a in answers if a[2] == 201), default=None)
        later = [a for a in answers if completed is not None and a[4] > completed]
        # Once the key's request has completed, every request for it is a replay.
        assert all((a[2], a[3]) == (201, "true") for a in later), answers
    # The Redis copy works again, on the slots that moved too.
    moved = next(
        f"after-{n}"
        for n in range(10_000)
        if cluster.master_of(redis_copy.redis_key("anonymous", f"after-{n}")) is promoted
    )
    client = APIClient()
    assert post(client, moved, name=moved).status_code == 201
    assert post(client, moved, name=moved)["Idempotent-Replay"] == "true"  # copied to Redis
    assert on_cluster.get(redis_copy.redis_key("anonymous", moved)).startswith(b"C")
    with django_assert_num_queries(0):
        assert post(client, moved, name=moved)["Idempotent-Replay"] == "true"
