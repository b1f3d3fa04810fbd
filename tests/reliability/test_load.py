"""Sustained load with retries and concurrent duplicates: exactly one effect per key.

Several client processes post for ``RELIABILITY_LOAD_SECONDS`` (60 by default) to gunicorn with
several workers, on a private PostgreSQL cluster. A tenth of the requests repeat an earlier key
after it was answered, a twentieth are the same new key sent from two threads at once.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

import pytest

from tests.reliability.load import (
    Load,
    LoadConfig,
    Outcome,
    figures,
    read_back,
    report,
    violations,
)

if TYPE_CHECKING:
    from tests.reliability.services import PrivatePostgres, Serve

pytest_plugins = ["tests.reliability.services"]

LOAD_SECONDS = float(os.environ.get("RELIABILITY_LOAD_SECONDS", "60"))


def test_load_with_retries_and_concurrent_duplicates_has_one_effect_per_key(
    private_postgres: PrivatePostgres, serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve(workers=4) as server:
        config = LoadConfig(port=server.port, seconds=LOAD_SECONDS, start_at=time.time() + 3)
        with Load(config) as load:
            outcomes = load.results()
    effects, keys = read_back(private_postgres, config.prefix)
    stats = figures(outcomes, config.seconds)
    report(capsys, "load", stats)

    problems = violations(outcomes, effects, allowed=frozenset({201, 409}), keys=keys)
    assert not problems, "\n".join(problems[:40])
    assert stats["sequential_retries"] and stats["concurrent_duplicates"], stats
    # A key answered before is always replayed, never refused.
    retries = [outcome for outcome in outcomes if outcome.kind == "retry"]
    assert all(o.status == 201 and o.replay == "true" for o in retries)
    # Every duplicate was answered 409 (with Retry-After, checked above) or replayed.
    assert stats["duplicates"] == stats["conflicts_409"] + stats["replays"], stats
    assert len(effects) == stats["keys"]


def test_the_checks_catch_a_second_effect_an_unfaithful_replay_and_a_500() -> None:
    """The load tests pass only if these checks can fail: they are checked on made-up answers."""

    def answer(
        status: int | None, body: dict[str, object] | None, replay: str = "false"
    ) -> Outcome:
        return Outcome(
            "k-1", "first", "/api/widget/", b"{}", 0.0, 0.0, status=status, replay=replay,
            retry_after="1", content_type="application/json",
            body=json.dumps(body).encode() if body else b"",
        )  # fmt: skip

    original = answer(201, {"id": 1, "name": "k-1"})
    assert violations([original], {"k-1": [1]}) == []
    assert violations([original], {"k-1": [1, 2]})  # two effects
    assert violations([original], {})  # an answer without its effect
    assert violations([original, answer(201, {"id": 1, "name": "k-1"})], {"k-1": [1]})  # ran twice
    assert violations([original, answer(201, {"id": 2, "name": "k-1"}, "true")], {"k-1": [1]})
    assert violations([original, answer(500, None)], {"k-1": [1]})
    assert violations([answer(409, None)], {})  # never served
