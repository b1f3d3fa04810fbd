"""Real server processes for tests: gunicorn serving the test project on the test database."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.db import connection

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a leftover of a crashed run, say)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Server:
    port: int
    process: subprocess.Popen[bytes]

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
        timeout: float = 30,
    ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            all_headers = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=payload, headers=all_headers)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()]


@contextlib.contextmanager
def gunicorn(workers: int = 1, **env: str) -> Iterator[Server]:
    """gunicorn on the database the current test uses; killed on exit, whatever happened."""
    port = free_port()
    command = [
        "gunicorn", "tests.support.wsgi:application", "--bind", f"127.0.0.1:{port}",
        "--workers", str(workers), "--timeout", "120", "--graceful-timeout", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    with _serve(command, port, env, workers=True) as server:
        yield server


@contextlib.contextmanager
def demo_gunicorn(workers: int = 2, *, log: Path | None = None, **env: str) -> Iterator[Server]:
    """gunicorn serving the demo with its own config, as ``make demo`` does; killed on exit.

    The demo's settings take the database from ``DATABASE_URL`` in ``env``, not from the test.
    """
    port = free_port()
    command = [
        "gunicorn", "--config", "python:demo_project.gunicorn_conf", "demo_project.wsgi",
        "--bind", f"127.0.0.1:{port}", "--workers", str(workers),
    ]  # fmt: skip
    env = {"DJANGO_SETTINGS_MODULE": "demo_project.settings", **env}
    with _serve(command, port, env, workers=True, test_database=False, log=log) as server:
        yield server


@contextlib.contextmanager
def uvicorn(**env: str) -> Iterator[Server]:
    """uvicorn (ASGI) on the database the current test uses; killed on exit."""
    port = free_port()
    command = [
        "uvicorn", "tests.support.asgi:application", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip
    with _serve(command, port, env, workers=False) as server:
        yield server


@contextlib.contextmanager
def _serve(
    command: list[str],
    port: int,
    env: dict[str, str],
    *,
    workers: bool,
    test_database: bool = True,
    log: Path | None = None,
) -> Iterator[Server]:
    """Serve with ``command``; ``test_database`` points it at the current test's database
    (which needs Django's settings in this process), ``log`` takes its output."""
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    if test_database:
        environment["TEST_DATABASE_NAME"] = str(connection.settings_dict["NAME"])
    environment |= {"PYTHONPATH": str(ROOT), **env}
    output = log.open("ab") if log is not None else None
    process = subprocess.Popen(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        env=environment,
        start_new_session=True,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
    )
    server = Server(port, process)
    try:
        _wait_until_listening(server, command[0], workers=workers)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        if output is not None:
            output.close()


def _wait_until_listening(
    server: Server, name: str, *, workers: bool, deadline: float = 60
) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if server.process.poll() is not None:
            raise RuntimeError(f"{name} exited with {server.process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", server.port), 1):
            if not workers or server.worker_pids():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not start listening")
