"""A private RabbitMQ node for fault tests: stopped, crashed and restarted while clients use it.

The shared broker on 5672 is never touched. The node gets its own name, free loopback ports, a
temporary directory for its database, logs, cookie and pid file, an empty plugins file (no
management listener) and a config file of its own, so nothing of the shared node's settings
applies. ``RabbitNode.running()`` starts it and, however the test ends, kills its process group
and removes the directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.backends import backends_required
from tests.support.ports import free_port

#: Where the Debian package keeps the real scripts: /usr/sbin/rabbitmq-server is a wrapper that
#: re-runs them as the rabbitmq user, with the shared node's log files and home.
_SCRIPT_DIRS = ("/usr/lib/rabbitmq/bin", "/usr/local/lib/rabbitmq/bin")
_START_TIMEOUT = 90.0


def _scripts_dir() -> Path | None:
    candidates = [Path(path) for path in _SCRIPT_DIRS]
    found = shutil.which("rabbitmq-server")
    if found:
        candidates.append(Path(found).resolve().parent)
    for directory in candidates:
        if all((directory / name).exists() for name in ("rabbitmq-server", "rabbitmqctl")):
            return directory
    return None


def _process_table() -> list[tuple[int, int]]:
    result = subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=False
    )
    return [
        (int(pid), int(ppid)) for pid, ppid in (line.split() for line in result.stdout.splitlines())
    ]


def _live_processes() -> dict[int, str]:
    """``{pid: command line}`` of every process but zombies and this one."""
    result = subprocess.run(
        ["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=False
    )
    rows = {}
    for line in result.stdout.splitlines():
        pid, state, args = (line.split(None, 2) + ["", ""])[:3]
        if not state.startswith("Z") and int(pid) != os.getpid():
            rows[int(pid)] = args
    return rows


@dataclass(frozen=True, slots=True)
class Outage:
    """One stop and start of the node, in seconds; ``total`` is how long clients had no broker
    (from the stop command to the node accepting connections again)."""

    how: str
    stopping: float
    starting: float
    total: float

    def __str__(self) -> str:
        return (
            f"{self.how}: {self.total:.1f} s (stop {self.stopping:.1f}, start {self.starting:.1f})"
        )


class RabbitNode:
    """One RabbitMQ node of this test run. ``url`` stays the same across restarts."""

    def __init__(self, scripts: Path, directory: Path) -> None:
        self.scripts = scripts
        self.directory = directory
        self.name = f"rel{os.getpid()}x{free_port()}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._pids: dict[int, str] = {}
        (directory / "enabled_plugins").write_text("[].\n")
        (directory / "rabbitmq-env.conf").write_text("")
        (directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            # Never refuse publishes because a busy test machine looks short of disk or memory.
            "disk_free_limit.absolute = 1MB\n"
            "vm_memory_high_watermark.relative = 0.9\n"
        )

    # --- environment --------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """For the server and for the CLI: the same HOME means the same Erlang cookie."""
        d = self.directory
        return {
            **os.environ,
            "HOME": str(d),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(d / "node.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def ctl(self, *args: str, tool: str = "rabbitmqctl", timeout: float = 60) -> str:
        result = subprocess.run(
            [str(self.scripts / tool), "-q", "-n", self.name, *args],
            env=self.env(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{tool} {' '.join(args)} failed ({result.returncode}): "
                f"{result.stderr.decode(errors='replace')[-2000:]}"
            )
        return result.stdout.decode(errors="replace")

    # --- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the node and return once it accepts AMQP connections."""
        assert self.process is None or self.process.poll() is not None, "already running"
        log = open(self.directory / f"server-{self.starts}.log", "wb")  # noqa: SIM115
        with log:
            self.process = subprocess.Popen(
                [str(self.scripts / "rabbitmq-server")],
                cwd=str(self.directory),
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.starts += 1
        self.wait_ready()
        self._remember_tree()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"RabbitMQ exited at start:\n{self.server_log()}")
            if self.accepts_connections():
                return
            time.sleep(0.2)
        raise RuntimeError(f"RabbitMQ did not start in {_START_TIMEOUT} s:\n{self.server_log()}")

    def accepts_connections(self) -> bool:
        """An AMQP handshake succeeds (a listening port alone may precede the vhost)."""
        import amqp

        connection = amqp.Connection(host=f"127.0.0.1:{self.port}", connect_timeout=2)
        try:
            connection.connect()
        except Exception:
            return False
        finally:
            with suppress(Exception):
                connection.close()
        return True

    def stop(self) -> None:
        """A clean shutdown (``rabbitmqctl stop``): clients get connection.close and EOF."""
        self._remember_tree()
        self.ctl("stop")
        self._reap(timeout=60)

    def crash(self) -> None:
        """SIGKILL the node: no goodbye to clients, no clean shutdown of its message store."""
        self._kill_group(signal.SIGKILL)
        self._reap(timeout=30)

    def restart_after(self, stop: str, down_seconds: float) -> Outage:
        """Stop (``"stop"`` or ``"crash"``), stay down, start again; how long each part took."""
        began = time.monotonic()
        getattr(self, stop)()
        stopped = time.monotonic()
        time.sleep(down_seconds)
        restarting = time.monotonic()
        self.start()
        ended = time.monotonic()
        return Outage(stop, stopped - began, ended - restarting, ended - began)

    def _kill_group(self, signum: int) -> None:
        """Kill the Erlang VM first, so the launching shell reaps it (no zombie left), then the
        rest of the group."""
        self._remember_tree()
        if self.process is None or self.process.poll() is not None:
            return
        for pid in self.leftover_processes():
            if "beam" in self._pids.get(pid, ""):
                with suppress(ProcessLookupError):
                    os.kill(pid, signum)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def _remember_tree(self) -> None:
        """Note the node's processes: the Erlang VM starts helpers in sessions of their own."""
        if self.process is None or self.process.poll() is not None:
            return
        children: dict[int, list[int]] = {}
        for pid, ppid in _process_table():
            children.setdefault(ppid, []).append(pid)
        live = _live_processes()
        todo = [self.process.pid]
        while todo:
            pid = todo.pop()
            if pid in live:
                # With its command line: a pid reused later by another process is not ours.
                self._pids[pid] = live[pid]
            todo.extend(children.get(pid, []))

    def _reap(self, timeout: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill_group(signal.SIGKILL)
            self.process.wait(30)
        deadline = time.monotonic() + 10
        while self.leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.leftover_processes():  # helpers that outlived the VM
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        self._pids = {
            pid: self._pids[pid] for pid in self.leftover_processes() if pid in self._pids
        }

    def leftover_processes(self) -> list[int]:
        """Live (not zombie) processes of this node, or naming its name or directory."""
        markers = (self.name.split("@")[0], str(self.directory))
        return [
            pid
            for pid, args in _live_processes().items()
            if self._pids.get(pid) == args or any(marker in args for marker in markers)
        ]

    def server_log(self) -> str:
        logs = sorted(self.directory.glob("server-*.log")) + sorted(
            (self.directory / "log").glob("*.log")
        )
        return "\n".join(path.read_text(errors="replace")[-3000:] for path in logs)

    def close(self) -> None:
        """Kill whatever is left of the node and delete its files."""
        self._kill_group(signal.SIGKILL)
        with suppress(Exception):
            self._reap(timeout=30)

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[RabbitNode]:
        scripts = _scripts_dir()
        if scripts is None:
            message = "rabbitmq-server is not installed: no private RabbitMQ node"
            if backends_required():
                pytest.fail(message)
            pytest.skip(message)
        directory = Path(tempfile.mkdtemp(prefix="rel-rabbit-"))
        node = cls(scripts, directory)
        try:
            node.start()
            yield node
        finally:
            node.close()
            leftovers = node.leftover_processes()
            shutil.rmtree(directory, ignore_errors=True)
            assert not leftovers, f"RabbitMQ processes left behind: {leftovers}"
