"""Live demo servers: compose's ``setup``, ``web`` and ``worker`` commands, on the suite's
database.

``demo_server`` runs as ``make demo`` runs it (fault injection on, a short lease) without Redis
or a broker: the outbox relay and the ledger consumer run in the server's process.
``broker_stack`` adds RabbitMQ, a Celery worker and beat, as docker compose does (PostgreSQL
pass only). Each has a database of its own on the backend the suite runs on (``TEST_DATABASE``).
Tests talk to them over HTTP, and to the worker through the broker.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from demo_project.payments.management.commands.idempotency_tour import Client
from tests.conftest import require_service
from tests.demo import stack
from tests.settings import TEST_DATABASE
from tests.support.backends import service_url
from tests.support.ports import free_port

#: Long enough for a slow payment (half of it) on a busy machine, short enough for the crash.
LEASE_SECONDS = 6
#: As ``make demo`` sets it: events claimed by a relay that the crash killed go out soon.
RELAY_LEASE_SECONDS = 10
#: How long the ledger consumer may take to catch up on a busy machine.
LEDGER_TIMEOUT = 90.0


@dataclass(frozen=True)
class DemoServer:
    url: str
    database_url: str
    log: Path
    env: dict[str, str]

    def client(self, user: str | None = None, password: str = "") -> Client:
        return Client(self.url, (user, password) if user else None, timeout=60)

    def balances(self) -> dict[str, Decimal]:
        return self.client().balances()

    def django(self, script: str) -> str:
        """Run ``script`` with the server's settings and database (as a shell would); its
        output."""
        result = subprocess.run(
            [sys.executable, "-c", f"import django\ndjango.setup()\n{script}"],
            env=self.env,
            cwd=stack.ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def ledger(self, transaction_id: str, count: int = 0) -> list[dict[str, Any]]:
        """The payment's ledger entries, once there are at least ``count`` of them."""
        entries: list[dict[str, Any]] = []

        def arrived() -> bool:
            entries[:] = self.client().ledger(transaction_id)
            return len(entries) >= count

        stack.wait_for(arrived, f"{count} ledger entries for {transaction_id}", LEDGER_TIMEOUT)
        return entries


@dataclass(frozen=True)
class BrokerStack:
    server: DemoServer
    worker_log: Path


@contextlib.contextmanager
def serving(workdir: Path, **variables: str) -> Iterator[DemoServer]:
    """A fresh database, ``setup`` run on it, and ``web`` serving it until the block ends."""
    base_url = None if TEST_DATABASE == "sqlite" else service_url(TEST_DATABASE)
    with stack.fresh_database(TEST_DATABASE, base_url, workdir) as database_url:
        port = free_port()
        env = stack.environment(
            DATABASE_URL=database_url,
            DEMO_FAULTS="1",
            IDEMPOTENCY_LEASE_SECONDS=str(LEASE_SECONDS),
            IDEMPOTENCY_RELAY_LEASE_SECONDS=str(RELAY_LEASE_SECONDS),
            GUNICORN_CMD_ARGS=f"--bind 127.0.0.1:{port}",
            **variables,
        )
        setup = subprocess.run(
            stack.command("setup"), env=env, cwd=stack.ROOT, capture_output=True, text=True
        )
        assert setup.returncode == 0, setup.stdout + setup.stderr
        log = workdir / "web.log"
        server = DemoServer(f"http://127.0.0.1:{port}", database_url, log, env)
        with stack.running(stack.command("web"), env, stack.ROOT, log) as process:
            stack.wait_for(
                lambda: process.poll() is not None or _answers(server), "the demo server to answer"
            )
            assert process.poll() is None, log.read_text()
            yield server


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    with serving(tmp_path_factory.mktemp("demo")) as server:
        yield server


@pytest.fixture(scope="module")
def broker_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerStack]:
    if TEST_DATABASE != "postgresql":
        pytest.skip("runs in the PostgreSQL pass, the stack's database")
    amqp_url = require_service("amqp")
    workdir = tmp_path_factory.mktemp("stack")
    # A queue of our own, so this stack's worker never takes anyone else's task; and a node name
    # of our own, as the container's hostname gives it in compose.
    name = f"demo-test-{uuid.uuid4().hex[:12]}"
    try:
        with serving(
            workdir,
            CELERY_BROKER_URL=amqp_url,
            CELERY_TASK_DEFAULT_QUEUE=name,
            HOSTNAME=name,
            CELERY_WORKER_HOSTNAME=f"celery@{name}",
        ) as server:
            worker_log = workdir / "worker.log"
            beat_dir = workdir / "beat"  # compose gives beat a fresh /tmp as its working directory
            beat_dir.mkdir()
            with (
                stack.running(
                    stack.command("worker"), server.env, stack.ROOT, worker_log
                ) as worker,
                stack.running(stack.command("beat"), server.env, beat_dir, workdir / "beat.log"),
            ):
                stack.wait_for_worker(worker, worker_log, server.env, stack.ROOT)
                yield BrokerStack(server, worker_log)
    finally:
        stack.delete_queue(amqp_url, name)


def _answers(server: DemoServer) -> bool:
    try:
        return server.client().request("GET", "/api/v1/demo/").status == 200
    except Exception:
        return False
