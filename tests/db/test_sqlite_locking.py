"""Issue 13, item 7: SQLite's default DEFERRED transactions fail concurrent requests with
"database is locked" (503); IMMEDIATE transactions, as check W003 and the docs say, queue them.

A real gunicorn with six threads serves the test project on a SQLite file of its own, migrated
for the test; six slow POSTs with different keys arrive together.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.servers import ROOT, Server, _wait_until_listening, free_port

pytestmark = [
    pytest.mark.concurrency,
    # Its own SQLite file whatever the suite's database: run it once, with the SQLite suite.
    pytest.mark.skipif(
        os.environ.get("TEST_DATABASE", "sqlite") != "sqlite", reason="runs with the SQLite suite"
    ),
]

REQUESTS = 6


@contextlib.contextmanager
def threaded_server(database: Path, mode: str, log: Path) -> Iterator[Server]:
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.support.settings_sqlite_file",
        "SQLITE_FILE": str(database),
        "SQLITE_TRANSACTION_MODE": mode,
        "PYTHONPATH": str(ROOT),
    }
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--verbosity", "0", "--skip-checks"],
        cwd=ROOT, env=environment, check=True,
    )  # fmt: skip
    port = free_port()
    stderr = log.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "tests.support.wsgi:application", "--bind",
         f"127.0.0.1:{port}", "--workers", "1", "--threads", str(REQUESTS), "--timeout", "120",
         "--log-level", "warning"],
        cwd=ROOT, env=environment, start_new_session=True, stderr=stderr,
    )  # fmt: skip
    server = Server(port, process)
    try:
        _wait_until_listening(server, "gunicorn", workers=True)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        stderr.close()


def six_slow_posts(server: Server) -> list[tuple[int, dict[str, object]]]:
    def post(n: int) -> tuple[int, dict[str, object]]:
        status, _, body = server.request(
            "POST",
            "/checkout/",
            {"name": f"order-{n}", "think": 1},
            headers={"Idempotency-Key": f"sqlite-{uuid.uuid4()}"},
        )
        return status, json.loads(body or b"{}")

    with ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(post, range(REQUESTS)))


def test_deferred_transactions_lock_out_concurrent_requests(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with threaded_server(tmp_path / "deferred.sqlite3", "DEFERRED", log) as server:
        answers = six_slow_posts(server)
    locked = [body for status, body in answers if status == 503]
    assert locked, answers
    assert {body.get("error") for body in locked} == {"idempotency_store_unavailable"}
    assert "database is locked" in log.read_text()


def test_immediate_transactions_serve_every_request(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with threaded_server(tmp_path / "immediate.sqlite3", "IMMEDIATE", log) as server:
        answers = six_slow_posts(server)
    assert [status for status, _ in answers] == [201] * REQUESTS, answers
    assert "database is locked" not in log.read_text()
