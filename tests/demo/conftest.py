"""A live demo server per test run: compose's ``setup`` and ``web`` commands, on the suite's
database.

The server runs as ``make demo`` runs it (fault injection on, a short lease) and without Redis or
a broker; its database is the backend the suite runs on (``TEST_DATABASE``), in a database of
its own. Tests talk to it over HTTP only.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

from demo_project.payments.management.commands.idempotency_tour import Client
from tests.backends import service_url
from tests.demo import stack
from tests.settings import TEST_DATABASE

#: Long enough for a slow payment (half of it) on a busy machine, short enough for the crash.
LEASE_SECONDS = 6


@dataclass(frozen=True)
class DemoServer:
    url: str
    database_url: str
    log: Path

    def client(self, user: str | None = None, password: str = "") -> Client:
        return Client(self.url, (user, password) if user else None, timeout=60)

    def balances(self) -> dict[str, Decimal]:
        return self.client().balances()


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    workdir = tmp_path_factory.mktemp("demo")
    base_url = None if TEST_DATABASE == "sqlite" else service_url(TEST_DATABASE)
    with stack.fresh_database(TEST_DATABASE, base_url, workdir) as database_url:
        port = stack.free_port()
        env = stack.environment(
            DATABASE_URL=database_url,
            DEMO_FAULTS="1",
            IDEMPOTENCY_LEASE_SECONDS=str(LEASE_SECONDS),
            GUNICORN_CMD_ARGS=f"--bind 127.0.0.1:{port}",
        )
        setup = subprocess.run(
            stack.command("setup"), env=env, cwd=stack.ROOT, capture_output=True, text=True
        )
        assert setup.returncode == 0, setup.stdout + setup.stderr
        log = workdir / "web.log"
        server = DemoServer(f"http://127.0.0.1:{port}", database_url, log)
        with stack.running(stack.command("web"), env, stack.ROOT, log) as process:
            stack.wait_for(
                lambda: process.poll() is not None or _answers(server), "the demo server to answer"
            )
            assert process.poll() is None, log.read_text()
            yield server


def _answers(server: DemoServer) -> bool:
    try:
        return server.client().request("GET", "/api/v1/demo/").status == 200
    except Exception:
        return False
