"""NATS JetStream for the tests: the shared server, throwaway streams, and private servers.

The shared nats-server (``NATS_URL``, by default ``nats://127.0.0.1:4222``, as on the
development machines and in CI) is never restarted: a test that needs to restart one starts a
private ``nats-server -js`` on a free port with a store directory of its own, and stops it
whatever happens. Streams get fresh names and are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest

from tests.support.backends import backends_required
from tests.support.servers import free_port

DEFAULT_URL = "nats://127.0.0.1:4222"
NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine on a loop of its own (the tests are sync, like the relay)."""
    return asyncio.run(coroutine)


def _reachable(url: str) -> bool:
    host_port = url.split("://", 1)[-1].rsplit("@", 1)[-1]
    host, _, port = host_port.partition(":")
    try:
        with socket.create_connection((host, int(port or 4222)), timeout=2):
            return True
    except OSError:
        return False


def nats_url() -> str:
    """The shared server's URL; skips (fails under ``REQUIRE_BACKENDS``) when it is down."""
    url = os.environ.get("NATS_URL", DEFAULT_URL)
    if not _reachable(url):
        if backends_required():
            raise RuntimeError(f"NATS is not reachable at {url} but REQUIRE_BACKENDS is set")
        pytest.skip(f"NATS is not reachable at {url}")
    return url


@dataclass
class Stream:
    """A throwaway stream capturing ``<prefix>.>``."""

    url: str
    name: str
    prefix: str

    def messages(self) -> list[Any]:
        """Every message in the stream, in order (read directly, no consumer)."""

        async def read() -> list[Any]:
            client = await nats.connect(self.url)
            try:
                manager = client.jsm()
                info = await manager.stream_info(self.name)
                first, last = info.state.first_seq, info.state.last_seq
                found = []
                for sequence in range(first, last + 1) if info.state.messages else ():
                    found.append(await manager.get_msg(self.name, sequence))
                return found
            finally:
                await client.close()

        return run(read())

    def message_ids(self) -> list[str]:
        return [message.headers["Nats-Msg-Id"] for message in self.messages()]


async def _add_stream(url: str, name: str, prefix: str, **config: Any) -> None:
    client = await nats.connect(url)
    try:
        await client.jetstream().add_stream(name=name, subjects=[f"{prefix}.>"], **config)
    finally:
        await client.close()


async def _delete_stream(url: str, name: str) -> None:
    client = await nats.connect(url)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await client.jetstream().delete_stream(name)
    finally:
        await client.close()


@contextlib.contextmanager
def stream(url: str, **config: Any) -> Iterator[Stream]:
    """A fresh file-stored stream (``duplicate_window`` in seconds), deleted afterwards."""
    token = uuid.uuid4().hex[:12]
    created = Stream(url=url, name=f"DI_TEST_{token.upper()}", prefix=f"ditest{token}")
    run(_add_stream(url, created.name, created.prefix, **config))
    try:
        yield created
    finally:
        run(_delete_stream(url, created.name))


class PrivateServer:
    """``nats-server -js`` of this test's own, on a free port, with a store directory that
    outlives :meth:`restart` (so streams and their deduplication state survive it).

    ``config``: a nats-server configuration file's text (users and their permissions, say),
    and ``credentials`` (``"user:password"``) for the server's own readiness probe."""

    def __init__(self, store: Path, config: str = "", credentials: str = "") -> None:
        if not Path(NATS_SERVER).exists():
            if backends_required():
                raise RuntimeError(f"{NATS_SERVER} is missing but REQUIRE_BACKENDS is set")
            pytest.skip("nats-server is not installed")
        self.store = store
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.config = config
        self.credentials = credentials
        self.process: subprocess.Popen[bytes] | None = None

    def url_with(self, credentials: str) -> str:
        """The server's URL with ``"user:password"`` in it."""
        return f"nats://{credentials}@127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [
            NATS_SERVER,
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-sd",
            str(self.store),
        ]
        if self.config:
            self.store.mkdir(parents=True, exist_ok=True)
            config = self.store / "nats-server.conf"
            config.write_text(self.config)
            command += ["-c", str(config)]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}")
            if _reachable(self.url) and self._jetstream_ready():
                return
            time.sleep(0.1)
        raise RuntimeError("the private nats-server did not start")

    def _jetstream_ready(self) -> bool:
        async def ask() -> bool:
            url = self.url_with(self.credentials) if self.credentials else self.url
            client = await nats.connect(url, allow_reconnect=False, connect_timeout=1)
            try:
                await client.jetstream().account_info()
                return True
            finally:
                await client.close()

        try:
            return run(ask())
        except Exception:
            return False

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the server. SIGTERM (a restart) writes what JetStream acknowledged to disk
        first; SIGKILL may lose the last acknowledged messages, which a single server only
        keeps in memory for a moment, so a restart here is a SIGTERM."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connected clients get no answer at all (a server that hangs).

        Returns once every thread of the server is stopped: the signal is delivered
        asynchronously, and a thread still running on the other core could otherwise answer
        what the test sends right after."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)
        tasks = Path(f"/proc/{self.process.pid}/task")
        deadline = time.monotonic() + 5
        while not all(_stopped(task) for task in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not stop on SIGSTOP")
            time.sleep(0.01)

    def resume(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)


def _stopped(task: Path) -> bool:
    """Whether a thread (``/proc/<pid>/task/<tid>``) is stopped by a signal; gone counts."""
    try:
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("T", "t")


@contextlib.contextmanager
def private_server(store: Path, config: str = "", credentials: str = "") -> Iterator[PrivateServer]:
    server = PrivateServer(store, config, credentials)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.resume()
        server.stop(signal.SIGKILL)
