"""Shared helpers for the outbox and consumer tests."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

from django.db import connection, connections, transaction

from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from django_idempotency.outbox.clock import DatabaseClock
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.memory import broker

REPO_ROOT = Path(__file__).resolve().parents[2]


def settings_with(**values: Any) -> Any:
    """``override_settings`` for some IDEMPOTENCY keys, keeping the test settings' others."""
    from django.conf import settings
    from django.test import override_settings

    return override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, **values})


def publish_committed(
    topic: str = "orders.paid", payload: Any = None, **kwargs: Any
) -> OutboxEvent:
    with transaction.atomic():
        return publish(topic, {"n": 1} if payload is None else payload, **kwargs)


class CeilingRandom(random.Random):
    """Backoff at the top of its jitter range, so one ``drain()`` never retries a failed event.

    With real jitter a first retry can fall due a few milliseconds later, inside the same drain.
    """

    def uniform(self, a: float, b: float) -> float:
        return b


def relays_back_off_in_full(monkeypatch: Any) -> None:
    """Every ``Relay`` made from here on, the ``outbox_relay`` command's too, uses
    :class:`CeilingRandom`: a failure counted in a test is counted once."""
    from types import SimpleNamespace

    monkeypatch.setattr(
        "django_idempotency.outbox.relay.random", SimpleNamespace(Random=CeilingRandom)
    )


def relay_all() -> None:
    """Relays everything due, once: a failed event waits for its next pass."""
    with Relay(rng=CeilingRandom()) as relay:
        relay.drain()


def published_ids() -> list[str]:
    return [str(message.event_id) for message in broker.snapshot()]


def is_postgresql() -> bool:
    return connection.vendor == "postgresql"


def database_now() -> datetime:
    """The time by the clock the relay goes by (the database's; the machine's on SQLite)."""
    with transaction.atomic():
        return DatabaseClock.read(connection).read_at


class HeldTransaction:
    """Runs ``work`` in a transaction on another thread and keeps it open until ``release()``."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.started = threading.Event()
        self._release = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with transaction.atomic():
                self.result = self.work()
                self.started.set()
                self._release.wait(60)
        except BaseException as exc:
            self.error = exc
            self.started.set()
        finally:
            connections.close_all()

    def __enter__(self) -> HeldTransaction:
        self._thread.start()
        assert self.started.wait(30), "the held transaction did not start"
        assert self.error is None, self.error
        return self

    def release(self) -> None:
        self._release.set()
        self._thread.join(30)
        assert self.error is None, self.error

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self.release()


@contextmanager
def spawned(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A child process in its own session, killed with its children however the test ends.

    Its output goes to a temporary file, shown when the test fails.
    """
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            args,
            cwd=str(REPO_ROOT),
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield process
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-5000:])
            raise
        finally:
            _kill(process)


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@contextmanager
def held_by_a_running_relay(*events: OutboxEvent) -> Iterator[None]:
    """Hold the session locks of leased events' batches on this connection, as the relay
    publishing them would: other relays then see that relay as alive (db/session_locks.py)."""
    from django_idempotency.db import session_locks

    using = connection.alias
    tokens = [event.relay_token for event in events if event.relay_token is not None]
    if not session_locks.enabled(using):
        yield
        return
    for token in tokens:
        session_locks.hold_batch(using, token)
    try:
        yield
    finally:
        for token in tokens:
            session_locks.let_go_of_batch(using, token)


def wait_for(condition: Callable[[], Any], *, timeout: float = 60, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def database_env() -> dict[str, str]:
    """What a child process needs to use this test's database."""
    return {
        "TEST_DATABASE_NAME": str(connection.settings_dict["NAME"]),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(REPO_ROOT),
    }
