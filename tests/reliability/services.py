"""Private PostgreSQL and Redis servers for the fault tests, started and removed by the suite.

The shared services are never stopped: a test that needs a database or a Redis to die gets its
own, on a free port, and kills or restarts that one. Each is removed in a finalizer, whatever
the test did; leftovers of an earlier run that crashed (its pytest process is gone) are removed
before a new one is made.

Used as a pytest plugin (``pytest_plugins = ["tests.reliability.services"]``) so the cluster is
made once per session, whichever test module asks first. Its classes may be imported by other
modules before that, so pytest is told not to rewrite it: PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.servers import ROOT, Server, free_port, gunicorn

PG_VERSION = "15"
#: Cluster names: ``reliability_<pid of the pytest process>_<suffix>``.
CLUSTER_PREFIX = "reliability_"
_CLUSTER_NAME = re.compile(rf"^{CLUSTER_PREFIX}(\d+)(_\w+)?$")
DATABASE = "reliability"
#: Where private Redis servers note their pid, so a later run can remove a crashed run's ones.
REDIS_STATE = Path(tempfile.gettempdir()) / "django_idempotency_reliability_redis"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for_port(port: int, deadline: float = 60, *, listening: bool = True) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5):
                up = True
        except OSError:
            up = False
        if up == listening:
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not {'open' if listening else 'close'} in time")


def _run(command: list[str], timeout: float = 120) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")


# --- PostgreSQL --------------------------------------------------------------------------------


@dataclass
class PrivatePostgres:
    """A PostgreSQL 15 cluster of Debian's pg_createcluster, on a port of its own, trust auth."""

    name: str
    port: int
    database: str = DATABASE

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{self.database}"

    def ctl(self, action: str, timeout: float = 120) -> None:
        _run(["pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, self.name, action],
             timeout=timeout)  # fmt: skip

    def start(self) -> float:
        """Start the server; returns the moment (``time.time()``) it first answered a query."""
        return self._until_accepting("start", down_first=False)

    def stop(self) -> None:
        """A fast shutdown: open connections are terminated, as in a failover or a reboot."""
        self.ctl("stop")

    def restart(self) -> float:
        """A real server restart (fast shutdown, then start), not a reload; returns the moment
        the new server first answered a query."""
        return self._until_accepting("restart", down_first=True)

    def _until_accepting(self, action: str, *, down_first: bool, deadline: float = 60) -> float:
        """Run ``action`` while polling the server: pg_ctlcluster returns seconds after the
        server is back, which would overstate how long clients had to wait."""
        end = time.monotonic() + deadline
        with ThreadPoolExecutor(1) as pool:
            command = pool.submit(self.ctl, action)
            went_down = not down_first
            accepting = None
            while accepting is None:
                if time.monotonic() > end:
                    raise RuntimeError(f"private PostgreSQL not back {deadline}s after {action}")
                up = self._answers()
                if not up:
                    went_down = True
                elif went_down or command.done():
                    accepting = time.time()
                time.sleep(0.01)
            command.result()
        return accepting

    def _answers(self) -> bool:
        try:
            with self.connect("postgres") as connection:
                connection.execute("SELECT 1")
        except Exception:  # any failure to connect or to answer means "not up"
            return False
        return True

    def connect(self, database: str | None = None) -> Any:
        """A psycopg connection in autocommit, for counting effects behind the server's back."""
        import psycopg

        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname=database or self.database,
            autocommit=True,
            connect_timeout=5,
        )

    def server_env(self) -> dict[str, str]:
        """The environment that points a Django process of the test project at this cluster."""
        return {
            "TEST_DATABASE": "postgresql",
            "POSTGRES_URL": self.url,
            "TEST_DATABASE_NAME": self.database,
            "DJANGO_SETTINGS_MODULE": "tests.reliability.settings_load",
            "PYTHONPATH": str(ROOT),
        }


def _clusters() -> list[str]:
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout
    return [
        line.split()[1]
        for line in listing.splitlines()
        if line.split() and line.split()[0] == PG_VERSION
    ]


def drop_stale_clusters() -> None:
    """Drop the clusters of earlier runs whose pytest process is gone."""
    for name in _clusters():
        match = _CLUSTER_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            drop_cluster(name)


def drop_cluster(name: str) -> None:
    subprocess.run(
        ["pg_dropcluster", "--stop", PG_VERSION, name],
        check=False,
        capture_output=True,
        timeout=120,
    )


def _migrate(postgres: PrivatePostgres) -> None:
    environment = {**os.environ, **postgres.server_env()}
    result = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"migrate on the private cluster failed:\n{result.stderr}")


@contextlib.contextmanager
def private_postgres_cluster(suffix: str = "load") -> Iterator[PrivatePostgres]:
    """Create, start and migrate a private cluster; drop it on exit, whatever happened."""
    if shutil.which("pg_createcluster") is None:
        pytest.skip("Debian's postgresql-common (pg_createcluster) is not installed")
    drop_stale_clusters()
    name = f"{CLUSTER_PREFIX}{os.getpid()}_{suffix}"
    drop_cluster(name)
    port = free_port()
    try:
        _run(["pg_createcluster", PG_VERSION, name, "--port", str(port),
              "-o", "max_connections=200",
              "--", "--auth=trust"])  # fmt: skip
        postgres = PrivatePostgres(name, port)
        postgres.start()
        with postgres.connect("postgres") as connection:
            connection.execute(f'CREATE DATABASE "{postgres.database}"')
        _migrate(postgres)
        yield postgres
    finally:
        drop_cluster(name)


@pytest.fixture(scope="session")
def private_postgres() -> Iterator[PrivatePostgres]:
    """One private cluster for the session, with the test project's schema."""
    with private_postgres_cluster() as postgres:
        yield postgres


# --- Redis -------------------------------------------------------------------------------------


@dataclass
class PrivateRedis:
    """A redis-server child process on a port of its own, without persistence: killing it
    loses every entry, as a Redis failover or a restart without a disk would."""

    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    history: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def _pidfile(self) -> Path:
        return REDIS_STATE / f"{os.getpid()}-{self.port}.pid"

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory),
             "--logfile", str(self.directory / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.history.append(self.process)
        REDIS_STATE.mkdir(exist_ok=True)
        self._pidfile.write_text(str(self.process.pid))
        _wait_for_port(self.port)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; clients see the connection refused at once."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        _wait_for_port(self.port, listening=False)

    def freeze(self) -> None:
        """SIGSTOP: the port still accepts connections, but nothing answers (a hung Redis)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def close(self) -> None:
        for process in self.history:
            if process.poll() is None:
                process.kill()
            process.wait(30)
        self._pidfile.unlink(missing_ok=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def kill_stale_redis() -> None:
    """Kill the private Redis servers of earlier runs whose pytest process is gone."""
    if not REDIS_STATE.is_dir():
        return
    for pidfile in REDIS_STATE.glob("*-*.pid"):
        owner = int(pidfile.name.split("-")[0])
        if _alive(owner):
            continue
        with contextlib.suppress(ValueError, OSError):
            pid = int(pidfile.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"redis-server" in cmdline:
                os.kill(pid, signal.SIGKILL)
        pidfile.unlink(missing_ok=True)


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A private redis-server for one test; the test may kill and start it again."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    kill_stale_redis()
    redis = PrivateRedis(free_port(), Path(tempfile.mkdtemp(prefix="reliability-redis-")))
    try:
        redis.start()
        yield redis
    finally:
        redis.close()


# --- gunicorn on the private cluster ----------------------------------------------------------


@contextlib.contextmanager
def load_server(postgres: PrivatePostgres, *, workers: int = 4, **env: str) -> Iterator[Server]:
    """gunicorn serving the test project on the private cluster (tests/servers.py's helper).

    ``--preload`` loads the project once in the master: every worker, including one forked to
    replace a killed worker, answers its first request at once instead of after a second of
    imports.
    """
    env = {"GUNICORN_CMD_ARGS": "--preload", **postgres.server_env(), **env}
    with gunicorn(workers=workers, **env) as server:
        yield server


#: ``serve(workers=..., **env)``, as the ``serve`` fixture gives it.
Serve = Callable[..., AbstractContextManager[Server]]


@pytest.fixture
def serve(private_postgres: PrivatePostgres) -> Serve:
    """``with serve(workers=4, **env) as server``: gunicorn on the private cluster."""
    return functools.partial(load_server, private_postgres)
