"""A PostgreSQL restart under a running relay costs the outage, not a lease or a poll.

``outbox_relay --loop`` runs on the private cluster with a 60 s lease and a 60 s poll, and writes
what it publishes to a file. The cluster restarts while a batch is published but not yet
acknowledged: the relay keeps the outcome and records it once the cluster answers, and it
listens again, so an event committed afterwards wakes it at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.reliability.outbox_helpers import Child, figures, wait_until
from tests.reliability.services import ROOT, PrivatePostgres

pytest_plugins = ["tests.reliability.services"]

LEASE_AND_POLL_SECONDS = 60

_PUBLISH = """
import django
django.setup()
from django.db import transaction
from django_idempotency.outbox import publish
with transaction.atomic():
    print(publish("rel.restart", {"n": 1}).event_id)
"""


def _publish_on(postgres: PrivatePostgres) -> str:
    """Commit one event on the private cluster, from a process of its own; its event id."""
    result = subprocess.run(
        [sys.executable, "-c", _PUBLISH],
        cwd=ROOT,
        env={**os.environ, **postgres.server_env()},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.split()[-1]


def _status(postgres: PrivatePostgres, event_id: str) -> str | None:
    try:
        with postgres.connect() as connection:
            row = connection.execute(
                "SELECT status FROM django_idempotency_outboxevent WHERE event_id = %s",
                [event_id],
            ).fetchone()
    except Exception:  # the cluster is still coming back
        return None
    return None if row is None else str(row[0])


def test_postgresql_restart_under_a_running_relay_costs_the_outage_not_a_lease(
    private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    sent, hold = tmp_path / "sent", tmp_path / "hold"
    hold.touch()
    env = {
        **private_postgres.server_env(),
        "DJANGO_SETTINGS_MODULE": "tests.support.settings_relay_file",
        "REL_SENT_FILE": str(sent),
        "REL_HOLD_FILE": str(hold),
        "REL_LEASE_SECONDS": str(LEASE_AND_POLL_SECONDS),
    }
    poll = str(LEASE_AND_POLL_SECONDS)
    args = [sys.executable, "-m", "django", "outbox_relay", "--loop", "--sleep", poll]
    relay = Child(args, env, "relay")

    def sent_ids() -> list[str]:
        return sent.read_text().split() if sent.exists() else []

    try:
        wait_until(lambda: "Relaying outbox events" in relay.output(), timeout=60, what="the relay")
        first = _publish_on(private_postgres)
        wait_until(lambda: first in sent_ids(), timeout=30, what="the first publish")
        # Published, not acknowledged: the batch waits on the hold file while the cluster
        # restarts under it.
        back_at = private_postgres.restart()
        hold.unlink()  # the relay goes on to its ack, on a connection the restart broke
        acked_at = time.time()
        wait_until(
            lambda: _status(private_postgres, first) == "PUBLISHED",
            timeout=LEASE_AND_POLL_SECONDS / 2,
            what="the kept outcome to be recorded",
            every=0.05,
        )
        recorded_at = time.time()
        wait_until(
            lambda: "listening for commits again" in relay.output(),
            timeout=30,
            what="LISTEN again",
        )
        second = _publish_on(private_postgres)
        committed_at = time.time()
        wait_until(
            lambda: second in sent_ids(),
            timeout=LEASE_AND_POLL_SECONDS / 2,
            what="the NOTIFY to wake the relay",
            every=0.01,
        )
        commit_to_publish = time.time() - committed_at
        assert relay.alive(), relay.tail()
    except BaseException:
        print(relay.tail())
        raise
    finally:
        relay.terminate()
        relay.close()
    figures(
        "relay across a PostgreSQL restart",
        outcome_recorded_after_the_cluster_answered_s=recorded_at - back_at,
        outcome_recorded_after_the_failed_ack_s=recorded_at - acked_at,
        commit_to_publish_after_restart_s=commit_to_publish,
        lease_and_poll_s=LEASE_AND_POLL_SECONDS,
    )
    # Each event went out once: the kept outcome was recorded, not abandoned to its lease.
    assert sent_ids() == [first, second]
