"""Faults under load: a web worker SIGKILLed mid-request, PostgreSQL restarted, Redis lost.

Each test runs the load driver for ``RELIABILITY_FAULT_SECONDS`` (12 by default) against
gunicorn on the private PostgreSQL cluster, breaks something in the middle, then retries every
key that has no 2xx yet until it has one. What must hold: exactly one effect per key, every 2xx
a faithful answer for that effect, no 500, and service back without anyone stepping in.
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Any

import pytest

from tests.reliability.load import (
    Load,
    LoadConfig,
    Outcome,
    figures,
    post,
    read_back,
    report,
    settle,
    sleep_until,
    violations,
)
from tests.reliability.services import Kill, kill_worker_mid_request

if TYPE_CHECKING:
    from tests.reliability.services import PrivatePostgres, PrivateRedis, Serve
    from tests.support.servers import Server

pytest_plugins = ["tests.reliability.services"]

FAULT_SECONDS = float(os.environ.get("RELIABILITY_FAULT_SECONDS", "12"))
#: A short lease, so a key whose request died is free again within seconds.
LEASE_SECONDS = "3"


def _start(port: int, seconds: float = FAULT_SECONDS, **options: Any) -> LoadConfig:
    return LoadConfig(port=port, seconds=seconds, start_at=time.time() + 2, **options)


def _first_ok_after(outcomes: list[Outcome], moment: float) -> float | None:
    """Seconds from ``moment`` to the end of the first 2xx request sent after it."""
    times = [o.finished for o in outcomes if o.ok and o.started >= moment]
    return round(min(times) - moment, 3) if times else None


# --- a web worker killed mid-request -----------------------------------------------------------


def kill_slow_request(postgres: PrivatePostgres, server: Server, prefix: str) -> Kill:
    """SIGKILL the gunicorn worker whose slow request is inside its transaction right now.

    A slow request sleeps in the view after inserting its Widget, so its database session is
    "idle in transaction" with that INSERT, which names the key, as its last statement.
    """
    return kill_worker_mid_request(
        postgres, server, f"%{prefix}-%-slow%", re.compile(rf"'({re.escape(prefix)}-[\w-]+-slow)'")
    )


def test_worker_killed_mid_request_loses_nothing_and_its_key_is_taken_over(
    private_postgres: PrivatePostgres, serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    # A long lease: a key recovered well inside it was taken over because its owner was gone.
    lease = "20"
    with serve(workers=4, IDEMPOTENCY_TEST_LEASE_SECONDS=lease) as server:
        config = _start(server.port, slow_fraction=0.2, slow_seconds=1.0)
        kills, early = [], []
        with Load(config) as load:
            for offset in (3, 7):
                sleep_until(config.start_at + offset)
                kill = kill_slow_request(private_postgres, server, config.prefix)
                assert kill.key is not None
                kills.append(kill)
                # The dead request's session lock went with its connection: a retry now takes
                # the key over (or, if PostgreSQL has not yet noticed the closed socket, is told
                # to come back within the lease).
                early.append(post(server.port, kill.key, *config.request_for(kill.key), "early"))
            outcomes = load.results()
        workers_after = server.worker_pids()
        settled = settle(server.port, outcomes)
    effects, keys = read_back(private_postgres, config.prefix)
    everything = outcomes + early + settled
    stats = figures(outcomes, config.seconds)
    stats["killed_keys"] = len(kills)
    stats["early_retry_answers"] = [(o.status, o.retry_after) for o in early]
    stats["settle_requests"] = len(settled)
    report(capsys, "worker SIGKILL", stats)

    problems = violations(everything, effects, allowed=frozenset({201, 409, None}), keys=keys)
    assert not problems, "\n".join(problems[:40])
    # Exactly the killed requests went unanswered; the master replaced the workers.
    assert {o.key for o in outcomes if o.status is None} == {kill.key for kill in kills}
    assert len(workers_after) == 4
    assert not {kill.pid for kill in kills} & set(workers_after)
    for answer in early:
        assert answer.status in (201, 409), answer.body
        if answer.status == 409:
            assert 1 <= int(answer.retry_after or 0) <= float(lease), answer.retry_after
    recovered = []
    for kill in kills:
        final = next(o for o in everything if o.key == kill.key and o.ok)
        # A retry took the dead request's key over (attempt 2) because its owner was gone,
        # not because its lease ran out.
        assert final.json()["attempt"] == 2, final.body
        assert final.replay == "false"
        recovered.append(round(final.finished - kill.at, 2))
    print(f"\nkilled keys taken over after (s): {recovered}; lease {lease} s")
    assert all(seconds < float(lease) / 2 for seconds in recovered), recovered


# --- PostgreSQL restarted ----------------------------------------------------------------------


def test_postgresql_restart_under_load_answers_503_and_recovers_by_itself(
    private_postgres: PrivatePostgres, serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve(workers=4, IDEMPOTENCY_TEST_LEASE_SECONDS=LEASE_SECONDS) as server:
        config = _start(server.port, max(FAULT_SECONDS, 14), slow_fraction=0.1, slow_seconds=0.3)
        with Load(config) as load:
            sleep_until(config.start_at + 2)
            restart_began = time.time()
            restarted = private_postgres.restart()  # fast shutdown and start
            sleep_until(config.start_at + 6)
            stop_began = time.time()
            private_postgres.stop()  # and stay down for a while
            time.sleep(3)
            started = private_postgres.start()
            outcomes = load.results()
        settled = settle(server.port, outcomes)
    effects, keys = read_back(private_postgres, config.prefix)
    everything = outcomes + settled
    unavailable = [o for o in outcomes if o.status == 503]
    stats = figures(outcomes, config.seconds)
    stats |= {
        "restart_down_s": round(restarted - restart_began, 2),
        "restart_503s": sum(restart_began <= o.started < stop_began for o in unavailable),
        "restart_recovered_s": _first_ok_after(outcomes, restarted),
        "stop_down_s": round(started - stop_began, 2),
        "stop_503s": sum(stop_began <= o.started for o in unavailable),
        "stop_recovered_s": _first_ok_after(outcomes, started),
        "503s_sent_after_back": sum(
            o.started >= restarted and o.started < stop_began or o.started >= started
            for o in unavailable
        ),
        "keys_with_503": len({o.key for o in unavailable}),
        # Keys whose request had claimed them when the database went away: the release could
        # not reach the database either, so a retry took the key over after its lease.
        "keys_taken_over": sum(attempts > 1 for _, attempts in keys.values()),
        "settle_requests": len(settled),
    }
    report(capsys, "PostgreSQL restart", stats)

    problems = violations(everything, effects, allowed=frozenset({201, 409, 503}), keys=keys)
    assert not problems, "\n".join(problems[:40])
    assert stats["restart_503s"] and stats["stop_503s"], "no client saw the database go away"
    assert stats["keys_taken_over"], "no request was between its claim and its completion"
    # Back without intervention: new requests succeed, and soon nothing is refused any more.
    assert stats["restart_recovered_s"] is not None
    assert stats["stop_recovered_s"] is not None
    late = [o for o in outcomes if o.started >= started + 2]
    assert late and all(o.status in (201, 409) for o in late), {o.status for o in late}
    # Every key that was refused with a 503 was then served, exactly once (checked above).
    assert {o.key for o in unavailable} <= {o.key for o in everything if o.ok}


# --- Redis lost --------------------------------------------------------------------------------


def _redis_entries(redis: PrivateRedis) -> dict[str, bytes]:
    """The Redis copy's entries by idempotency key (``...idem:<n>:<scope>:<key>``)."""
    client = redis.client()
    entries = {}
    try:
        for name in client.scan_iter(match="*idem:*", count=1000):
            value = client.get(name)
            if value is not None:
                entries[name.decode().rsplit(":", 1)[1]] = bytes(value)
    finally:
        client.close()
    return entries


def test_redis_hung_then_lost_under_load_falls_back_to_the_database_and_comes_back(
    private_postgres: PrivatePostgres,
    private_redis: PrivateRedis,
    serve: Serve,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serve(workers=4, RELIABILITY_REDIS_URL=private_redis.url) as server:
        config = _start(server.port, max(FAULT_SECONDS, 15))
        at = [config.start_at + config.seconds * n / 5 for n in range(1, 5)]
        with Load(config) as load:
            sleep_until(at[0])
            entries_before = len(_redis_entries(private_redis))
            frozen = time.time()
            private_redis.freeze()  # hung: every command runs into the socket timeout
            sleep_until(at[1])
            private_redis.thaw()
            thawed = time.time()
            sleep_until(at[2])
            killed = time.time()
            private_redis.kill()  # gone: every connection is refused, every entry lost
            sleep_until(at[3])
            private_redis.start()
            back = time.time()
            outcomes = load.results()
        entries_after = _redis_entries(private_redis)
    effects, keys = read_back(private_postgres, config.prefix)
    # A key is copied to Redis at its first replay by the database (not at its completion).
    later = {o.key for o in outcomes if o.ok and o.replay == "true" and o.started > back + 1}
    cached_later = {key for key in later if entries_after.get(key, b"").startswith(b"C")}

    def answered(start: float, end: float) -> int:
        """2xx answers to requests sent while Redis was failing."""
        return sum(o.ok for o in outcomes if start < o.started < end)

    stats = figures(outcomes, config.seconds)
    stats |= {
        "redis_entries_before_faults": entries_before,
        "answered_while_redis_hung": answered(frozen, thawed),
        "latency_while_redis_hung_p50_ms": figures(
            [o for o in outcomes if frozen < o.started < thawed], 1
        )["latency_p50_ms"],
        "answered_while_redis_down": answered(killed, back),
        "keys_replayed_after_return": len(later),
        "keys_replayed_after_return_cached_in_redis": len(cached_later),
    }
    report(capsys, "Redis hung and lost", stats)

    # Served from the database alone, correctly: no 5xx at all, one effect per key.
    problems = violations(outcomes, effects, allowed=frozenset({201, 409}), keys=keys)
    assert not problems, "\n".join(problems[:40])
    assert entries_before > 0, "the Redis copy was not in use before Redis failed"
    assert stats["answered_while_redis_hung"] > 0
    assert stats["answered_while_redis_down"] > 0
    # The Redis copy is used again: keys replayed after Redis came back are copied to it.
    assert later and len(cached_later) >= len(later) / 2, stats
