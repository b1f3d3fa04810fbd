"""Private PostgreSQL, MariaDB and Redis servers for the fault tests, started and removed by the
suite.

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
from typing import Any, Protocol

import pytest

from tests.support.servers import ROOT, Server, free_port, gunicorn, process_alive

PG_VERSION = "15"
#: Cluster names: ``reliability_<pid of the pytest process>_<suffix>``.
CLUSTER_PREFIX = "reliability_"
_CLUSTER_NAME = re.compile(rf"^{CLUSTER_PREFIX}(\d+)(_\w+)?$")
DATABASE = "reliability"
#: Where private Redis servers note their pid, so a later run can remove a crashed run's ones.
REDIS_STATE = Path(tempfile.gettempdir()) / "django_idempotency_reliability_redis"
#: Private MariaDB servers live in ``<pid of the run>-<port>/`` here: data, socket, pid file, log.
MARIADB_STATE = Path(tempfile.gettempdir()) / "django_idempotency_reliability_mariadb"


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


class PrivateDatabase(Protocol):
    """What the chaos run and the worker kills need of a private server, whichever it is."""

    #: Django's ``connection.vendor`` for it, and the name a report gives it.
    vendor: str
    label: str
    port: int
    database: str

    @property
    def url(self) -> str: ...

    @property
    def log(self) -> Path: ...

    def start(self) -> float: ...

    def stop(self) -> None: ...

    def crash(self) -> None: ...

    def restart(self) -> float: ...

    def connect(self, database: str | None = None) -> Any: ...

    def in_transaction(
        self, connection: Any, like: str, session: tuple[int, str] | None = None
    ) -> list[tuple[int, str]]: ...


@dataclass
class PrivatePostgres:
    """A PostgreSQL 15 cluster of Debian's pg_createcluster, on a port of its own, trust auth."""

    name: str
    port: int
    database: str = DATABASE
    vendor: str = "postgresql"
    label: str = "PostgreSQL"

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{self.database}"

    @property
    def log(self) -> Path:
        """The cluster's server log, dropped with the cluster."""
        return Path(f"/var/log/postgresql/postgresql-{PG_VERSION}-{self.name}.log")

    def ctl(self, action: str, timeout: float = 120) -> None:
        _run(["pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, self.name, action],
             timeout=timeout)  # fmt: skip

    def start(self) -> float:
        """Start the server; returns the moment (``time.time()``) it first answered a query."""
        return self._until_accepting("start", down_first=False)

    def stop(self) -> None:
        """A fast shutdown: open connections are terminated, as in a failover or a reboot."""
        self.ctl("stop")

    def crash(self) -> None:
        """An immediate shutdown: no checkpoint, and WAL not yet flushed is lost, as when the
        machine loses power. The next start recovers from the WAL on disk."""
        _run(["pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, self.name, "stop",
              "-m", "immediate"])  # fmt: skip

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

    def in_transaction(
        self, connection: Any, like: str, session: tuple[int, str] | None = None
    ) -> list[tuple[int, str]]:
        """``(client port, last statement)`` of the sessions idle inside a transaction whose last
        statement matches ``like``; with ``session``, that one if it still is."""
        query = (
            "SELECT client_port, query FROM pg_stat_activity "
            "WHERE datname = %s AND state = 'idle in transaction' AND query LIKE %s"
        )
        params: list[Any] = [self.database, like]
        if session is not None:
            query += " AND client_port = %s AND query = %s"
            params += list(session)
        return [(int(port), text) for port, text in connection.execute(query, params).fetchall()]

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
        if match and not process_alive(int(match.group(1))):
            drop_cluster(name)


def drop_cluster(name: str) -> None:
    subprocess.run(
        ["pg_dropcluster", "--stop", PG_VERSION, name],
        check=False,
        capture_output=True,
        timeout=120,
    )


#: What points a Django process at a private server: by default the test project's settings.
ServerEnv = Callable[[Any], dict[str, str]]


def _migrate(server: PrivateDatabase, server_env: ServerEnv) -> None:
    environment = {**os.environ, **server_env(server)}
    result = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"migrate on the private {server.label} failed:\n{result.stderr}")


@contextlib.contextmanager
def private_postgres_cluster(
    suffix: str = "load", *, server_env: ServerEnv = PrivatePostgres.server_env
) -> Iterator[PrivatePostgres]:
    """Create, start and migrate a private cluster; drop it on exit, whatever happened.

    ``server_env`` names the project whose migrations run (the chaos run migrates the demo's).
    """
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
        _migrate(postgres, server_env)
        yield postgres
    finally:
        drop_cluster(name)


@pytest.fixture(scope="session")
def private_postgres() -> Iterator[PrivatePostgres]:
    """One private cluster for the session, with the test project's schema."""
    with private_postgres_cluster() as postgres:
        yield postgres


# --- MariaDB -----------------------------------------------------------------------------------

MARIADBD = "/usr/sbin/mariadbd"


class _Session:
    """A MySQLdb connection with psycopg's ``execute()``, so the same code reads either server."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def execute(self, query: str, params: list[Any] | None = None) -> Any:
        cursor = self.connection.cursor()
        cursor.execute(query, params)
        return cursor

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.connection.close()


@dataclass
class PrivateMariaDB:
    """A mariadbd child process on a port of its own, its data directory made by
    mariadb-install-db: root with an empty password, as on the shared server.

    Stopped with SIGTERM (a clean shutdown: open connections are cut) or SIGKILL (InnoDB
    recovers from its redo log at the next start). Its ``performance_schema`` keeps each
    session's last statement and the state of its transaction, so a worker can be caught inside
    its transaction as ``pg_stat_activity`` allows on PostgreSQL.
    """

    port: int
    directory: Path
    database: str = DATABASE
    vendor: str = "mysql"
    label: str = "MariaDB"
    process: subprocess.Popen[bytes] | None = None
    history: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/{self.database}"

    @property
    def log(self) -> Path:
        """The server's error log (deadlocks included), gone with the server."""
        return self.directory / "error.log"

    @property
    def _pidfile(self) -> Path:
        """Written by us, not by mariadbd (which removes its own on a clean stop): the process a
        later run kills if this one crashed."""
        return self.directory / "server.pid"

    def install(self) -> None:
        _run(["mariadb-install-db", "--no-defaults", "--auth-root-authentication-method=normal",
              f"--datadir={self.directory / 'data'}", f"--user={_user()}",
              "--skip-test-db"])  # fmt: skip

    def start(self, deadline: float = 60) -> float:
        """Start the server; returns the moment (``time.time()``) it first answered a query."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.process = subprocess.Popen(
            [MARIADBD, "--no-defaults", f"--datadir={self.directory / 'data'}",
             f"--port={self.port}", "--bind-address=127.0.0.1",
             f"--socket={self.directory / 'sock'}", f"--pid-file={self.directory / 'mariadbd.pid'}",
             f"--log-error={self.log}", f"--user={_user()}",
             "--max-connections=200", "--innodb-buffer-pool-size=128M",
             "--innodb-print-all-deadlocks=ON",
             "--performance-schema=ON",
             "--performance-schema-consumer-events-statements-current=ON",
             "--performance-schema-instrument=transaction=ON",
             "--performance-schema-consumer-events-transactions-current=ON"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.history.append(self.process)
        self._pidfile.write_text(str(self.process.pid))
        end = time.monotonic() + deadline
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > end:
                log = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"private MariaDB did not start:\n{log}")
            time.sleep(0.01)
        return time.time()

    def stop(self) -> None:
        """SIGTERM: a clean shutdown that cuts every open connection, as in a restart."""
        self._signal(signal.SIGTERM)

    def crash(self) -> None:
        """SIGKILL: no shutdown at all, as when the machine loses power."""
        self._signal(signal.SIGKILL)

    def restart(self) -> float:
        """Stop (SIGTERM) and start; returns the moment the new server first answered."""
        self.stop()
        return self.start()

    def _signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)
            self.process.wait(120)
        _wait_for_port(self.port, listening=False)

    def _answers(self) -> bool:
        try:
            with self.connect("mysql") as connection:
                connection.execute("SELECT 1")
        except Exception:  # any failure to connect or to answer means "not up"
            return False
        return True

    def connect(self, database: str | None = None) -> _Session:
        """A MySQLdb connection in autocommit, for counting effects behind the server's back."""
        import MySQLdb

        connection = MySQLdb.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            passwd="",
            db=database or self.database,
            autocommit=True,
            connect_timeout=5,
            charset="utf8mb4",
        )
        return _Session(connection)

    def in_transaction(
        self, connection: Any, like: str, session: tuple[int, str] | None = None
    ) -> list[tuple[int, str]]:
        """As :meth:`PrivatePostgres.in_transaction`: a session sleeping (between statements)
        with its transaction open; its last statement and that transaction's state from
        ``performance_schema``.

        Not from ``information_schema.INNODB_TRX``: InnoDB refreshes that copy only when nobody
        has read it for 0.1 s, so polled every 20 ms it stays as the first poll found it, and a
        transaction begun after that is never seen (a worker kill found nothing in 10 s).
        ``events_transactions_current`` is the server's live state.
        """
        query = (
            "SELECT p.HOST, s.SQL_TEXT FROM information_schema.PROCESSLIST p "
            "JOIN performance_schema.threads t ON t.PROCESSLIST_ID = p.ID "
            "JOIN performance_schema.events_statements_current s ON s.THREAD_ID = t.THREAD_ID "
            "JOIN performance_schema.events_transactions_current x ON x.THREAD_ID = t.THREAD_ID "
            "WHERE p.DB = %s AND p.COMMAND = 'Sleep' AND s.SQL_TEXT LIKE %s "
            "AND x.STATE = 'ACTIVE'"
        )
        params: list[Any] = [self.database, like]
        if session is not None:
            query += " AND SUBSTRING_INDEX(p.HOST, ':', -1) = %s AND s.SQL_TEXT = %s"
            params += [str(session[0]), session[1]]
        rows = connection.execute(query, params).fetchall()
        return [(int(host.rsplit(":", 1)[1]), text) for host, text in rows]

    def server_env(self) -> dict[str, str]:
        """The environment that points a Django process of the test project at this server."""
        return {
            "TEST_DATABASE": "mariadb",
            "MARIADB_URL": self.url,
            "TEST_DATABASE_NAME": self.database,
            "DJANGO_SETTINGS_MODULE": "tests.reliability.settings_load",
            "PYTHONPATH": str(ROOT),
        }

    def close(self) -> None:
        for process in self.history:
            if process.poll() is None:
                process.kill()
            process.wait(30)
        shutil.rmtree(self.directory, ignore_errors=True)


def _user() -> str:
    """mariadbd runs as root only when told to; as anyone else, as that user."""
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def kill_stale_mariadb() -> None:
    """Kill the private MariaDB servers of earlier runs whose process is gone; remove their data."""
    if not MARIADB_STATE.is_dir():
        return
    for directory in MARIADB_STATE.iterdir():
        owner = directory.name.split("-")[0]
        if not owner.isdigit() or process_alive(int(owner)):
            continue
        with contextlib.suppress(ValueError, OSError):
            pid = int((directory / "server.pid").read_text())
            if b"mariadbd" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def private_mariadb_server(
    suffix: str = "load",
    *,
    server_env: ServerEnv = PrivateMariaDB.server_env,
    migrate: bool = True,
) -> Iterator[PrivateMariaDB]:
    """Install, start and (unless ``migrate`` is False) migrate a private MariaDB; kill it and
    remove its data on exit, whatever happened. ``server_env`` as for
    :func:`private_postgres_cluster`."""
    for tool in (MARIADBD, "mariadb-install-db"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (mariadb-server)")
    kill_stale_mariadb()
    port = free_port()
    mariadb = PrivateMariaDB(port, MARIADB_STATE / f"{os.getpid()}-{port}-{suffix}")
    try:
        mariadb.directory.mkdir(parents=True)
        mariadb.install()
        mariadb.start()
        with mariadb.connect("mysql") as connection:
            connection.execute(
                f"CREATE DATABASE `{mariadb.database}` "
                "CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
            )
        if migrate:
            _migrate(mariadb, server_env)
        yield mariadb
    finally:
        mariadb.close()


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
        if process_alive(owner):
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
    """gunicorn serving the test project on the private cluster (tests/support/servers.py's helper).

    ``--preload`` loads the project once in the master: every worker, including one forked to
    replace a killed worker, answers its first request at once instead of after a second of
    imports.
    """
    env = {"GUNICORN_CMD_ARGS": "--preload", **postgres.server_env(), **env}
    with gunicorn(workers=workers, **env) as server:
        yield server


@dataclass
class Kill:
    pid: int
    #: The idempotency key the killed request was serving, when its statement names it.
    key: str | None
    at: float


def socket_owner(pids: list[int], local_port: int, remote_port: int) -> int | None:
    """The process among ``pids`` holding the TCP socket 127.0.0.1:local_port -> remote_port."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if (
                int(local.rsplit(":", 1)[1], 16) == local_port
                and int(remote.rsplit(":", 1)[1], 16) == remote_port
            ):
                inodes.add(f"socket:[{inode}]")
    for pid in pids:
        with contextlib.suppress(OSError):  # a worker that exited meanwhile
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return pid
    return None


def kill_worker_mid_request(
    database: PrivateDatabase,
    server: Server,
    like: str,
    key: re.Pattern[str] | None = None,
    deadline: float = 10,
) -> Kill:
    """SIGKILL a gunicorn worker whose request is inside its transaction right now.

    The request is caught between two statements of its transaction: its session is idle in a
    transaction with a last statement matching ``like`` (SQL LIKE), and the session's client
    port leads to the worker process. The worker is stopped first and the session looked at
    again, so the kill cannot land after the request moved on. ``key``, a pattern with one
    group, reads the request's idempotency key from that statement.
    """
    end = time.monotonic() + deadline
    with database.connect() as connection:
        while time.monotonic() < end:
            for client_port, query in database.in_transaction(connection, like):
                match = key.search(query) if key is not None else None
                pid = socket_owner(server.worker_pids(), client_port, database.port)
                if not pid or (key is not None and not match):
                    continue
                os.kill(pid, signal.SIGSTOP)
                if database.in_transaction(connection, like, (client_port, query)):
                    os.kill(pid, signal.SIGKILL)
                    return Kill(pid, match.group(1) if match else None, time.time())
                os.kill(pid, signal.SIGCONT)  # it moved on meanwhile: look again
            time.sleep(0.02)
    raise AssertionError("no request was inside its transaction to kill")


#: ``serve(workers=..., **env)``, as the ``serve`` fixture gives it.
Serve = Callable[..., AbstractContextManager[Server]]


@pytest.fixture
def serve(private_postgres: PrivatePostgres) -> Serve:
    """``with serve(workers=4, **env) as server``: gunicorn on the private cluster."""
    return functools.partial(load_server, private_postgres)
