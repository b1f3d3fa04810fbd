"""A PostgreSQL crash loses no answer a client was given, though claims commit asynchronously.

The claim commits with ``synchronous_commit`` off (db/postgresql.py, ``claim_statement``): its
commit does not wait for the WAL flush. The business transaction that completes the record
commits synchronously, flushing the WAL up to itself and so the claim before it. Here the private
cluster's WAL writer is slowed to once every 10 s, and the cluster is stopped in immediate mode
(no checkpoint: what was not flushed is lost, as in a power cut): once with a request completed,
once with a request claimed and still running.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.reliability.outbox_helpers import figures, wait_until
from tests.reliability.services import PrivatePostgres, Serve

pytest_plugins = ["tests.reliability.services"]


def _query(postgres: PrivatePostgres, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    with postgres.connect() as connection:
        return list(connection.execute(sql, params).fetchall())


def _set_wal_writer_delay(postgres: PrivatePostgres, value: str | None) -> None:
    with postgres.connect() as connection:
        if value is None:
            connection.execute("ALTER SYSTEM RESET wal_writer_delay")
        else:
            connection.execute(f"ALTER SYSTEM SET wal_writer_delay = '{value}'")
        connection.execute("SELECT pg_reload_conf()")


def test_a_crash_loses_no_completed_answer_and_no_claim_that_guarded_an_effect(
    private_postgres: PrivatePostgres, serve: Serve, tmp_path: Path
) -> None:
    done_key, held_key = f"done-{uuid.uuid4()}", f"held-{uuid.uuid4()}"
    hold = tmp_path / "hold"
    held_answer: list[int] = []
    _set_wal_writer_delay(private_postgres, "10s")
    try:
        with serve(workers=2, IDEMPOTENCY_TEST_LEASE_SECONDS="30") as server:
            status, _, first_body = server.request(
                "POST", "/api/widget/", {"name": done_key}, {"Idempotency-Key": done_key}
            )
            assert status == 201, first_body
            hold.touch()
            held_body = {"name": held_key, "hold_file": str(hold)}

            def held_request() -> None:
                try:
                    answer = server.request(
                        "POST", "/api/widget/", held_body, {"Idempotency-Key": held_key}
                    )
                    held_answer.append(answer[0])
                except OSError:
                    held_answer.append(0)  # the connection broke with the server's database

            thread = threading.Thread(target=held_request, daemon=True)
            thread.start()
            claimed = "SELECT status FROM django_idempotency_idempotencyrecord WHERE key = %s"
            wait_until(
                lambda: _query(private_postgres, claimed, [held_key]),
                timeout=30,
                what="the held request's claim",
                every=0.02,
            )
            private_postgres.crash()
            hold.unlink()
            thread.join(60)
            private_postgres.start()
            claim_survived = bool(_query(private_postgres, claimed, [held_key]))

            def retried(key: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
                deadline = time.monotonic() + 60
                while True:
                    answer = server.request("POST", "/api/widget/", body, {"Idempotency-Key": key})
                    if answer[0] not in (409, 503) or time.monotonic() > deadline:
                        return answer
                    time.sleep(0.2)

            status, headers, body = retried(done_key, {"name": done_key})
            assert (status, body) == (201, first_body), "the completed answer did not survive"
            assert headers.get("Idempotent-Replay") == "true"
            # The same request again (its hold file is gone now): one effect in all.
            status, _, body = retried(held_key, held_body)
            assert status == 201, body
    finally:
        hold.unlink(missing_ok=True)
        _set_wal_writer_delay(private_postgres, None)
    widgets = "SELECT name, count(*) FROM testapp_widget WHERE name IN (%s, %s) GROUP BY name"
    counts = dict(_query(private_postgres, widgets, [done_key, held_key]))
    assert counts == {done_key: 1, held_key: 1}, counts
    figures(
        "PostgreSQL crash",
        held_request_answer=held_answer,
        held_claim_survived_the_crash=claim_survived,
    )
