"""Run the demo's services the way docker-compose.yml runs them, against this machine's services.

The commands come from docker-compose.yml itself, so the file cannot drift from what is tested:
only the service addresses in the environment change.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import environ
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
#: What the services need from the environment when they run here rather than in compose.
SERVICE_VARIABLES = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")


def compose() -> dict[str, Any]:
    with COMPOSE_FILE.open() as file:
        loaded: dict[str, Any] = yaml.safe_load(file)
    return loaded


def command(service: str) -> list[str]:
    """The service's command, with ``python`` meaning this interpreter."""
    argv = [str(part) for part in compose()["services"][service]["command"]]
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def healthcheck(service: str) -> list[str]:
    """The service's healthcheck as a command to run here (compose's ``$$`` is a literal ``$``)."""
    test = [
        str(part).replace("$$", "$")
        for part in compose()["services"][service]["healthcheck"]["test"]
    ]
    kind, rest = test[0], test[1:]
    if kind == "CMD-SHELL":
        return ["sh", "-c", rest[0].replace("python ", f"{sys.executable} ", 1)]
    return [sys.executable if rest[0] == "python" else rest[0], *rest[1:]]


def healthy(service: str, env: dict[str, str], cwd: Path) -> bool:
    """Whether the service's healthcheck, run here, passes."""
    result = subprocess.run(
        healthcheck(service), env=env, cwd=cwd, capture_output=True, timeout=120
    )
    return result.returncode == 0


def delete_queue(amqp_url: str, name: str) -> None:
    """Delete a test's queue and the exchange of the same name that Celery declares for it."""
    from kombu import Connection

    with Connection(amqp_url) as connection:
        channel = connection.channel()
        channel.queue_delete(name)
        channel.exchange_delete(name)


def environment(**variables: str) -> dict[str, str]:
    """This process's environment without its service addresses, plus ``variables``."""
    env = {name: value for name, value in os.environ.items() if name not in SERVICE_VARIABLES}
    env["DJANGO_SETTINGS_MODULE"] = "demo_project.settings"
    env["PYTHONPATH"] = str(ROOT)
    env.update(variables)
    return env


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    """Poll until ``predicate`` holds; generous, since the machine may be busy."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def wait_for_worker(
    process: subprocess.Popen[bytes], log: Path, env: dict[str, str], cwd: Path
) -> None:
    """Until the worker's healthcheck passes, run only once the worker has logged that it is
    ready: before that each run is a Python start-up and a ``celery inspect ping`` that waits its
    whole 5 s timeout for an answer that cannot come."""
    wait_for(
        lambda: process.poll() is not None or b" ready." in log.read_bytes(), "the worker's start"
    )
    assert process.poll() is None, log.read_text(errors="replace")[-3000:]
    wait_for(lambda: healthy("worker", env, cwd), "the worker's healthcheck")


@contextlib.contextmanager
def running(
    argv: list[str], env: dict[str, str], cwd: Path, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` for the duration of the block, then stop it as compose would (SIGTERM)."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield process
        finally:
            stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        # Our own process group only (started with start_new_session).
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


# --- one database per run, on the backend the suite runs against ------------------------------


@contextlib.contextmanager
def fresh_database(backend: str, base_url: str | None, workdir: Path) -> Iterator[str]:
    """A DATABASE_URL for an empty database of its own, dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{workdir / 'demo.sqlite3'}"
        return
    assert base_url is not None
    config = environ.Env.db_url_config(base_url)
    name = f"{config['NAME']}_demo_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = _postgresql_admin if backend == "postgresql" else _mariadb_admin
    admin(config, f"CREATE DATABASE {name}")
    try:
        yield urlunsplit(urlsplit(base_url)._replace(path=f"/{name}"))
    finally:
        admin(config, f"DROP DATABASE IF EXISTS {name}")


def _postgresql_admin(config: dict[str, Any], statement: str) -> None:
    import psycopg

    with psycopg.connect(
        host=config["HOST"] or None,
        port=config["PORT"] or None,
        user=config["USER"] or None,
        password=config["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    ) as connection:
        connection.execute(statement)  # type: ignore[arg-type]


def _mariadb_admin(config: dict[str, Any], statement: str) -> None:
    import MySQLdb

    connection = MySQLdb.connect(
        host=config["HOST"] or "127.0.0.1",
        port=int(config["PORT"] or 3306),
        user=config["USER"],
        password=config["PASSWORD"] or "",
    )
    try:
        connection.cursor().execute(
            statement + (" CHARACTER SET utf8mb4" if statement.startswith("CREATE") else "")
        )
    finally:
        connection.close()


def compose_client() -> list[str] | None:
    """``docker compose`` or ``docker-compose``, whichever can read a compose file here."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None
