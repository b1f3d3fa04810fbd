"""Where the test suite finds its services.

Each service's URL comes from the environment (``POSTGRES_URL``, ``MARIADB_URL``, ``REDIS_URL``,
``AMQP_URL``). When one is unset and a Docker engine answers, a throwaway container is started
with testcontainers. Otherwise tests that need the service are skipped, unless
``REQUIRE_BACKENDS`` is set (as ``.ci/run`` sets it), in which case the run fails.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from functools import cache
from typing import Any

ENV_VARS = {
    "postgresql": "POSTGRES_URL",
    "mariadb": "MARIADB_URL",
    "redis": "REDIS_URL",
    "amqp": "AMQP_URL",
}


class BackendUnavailable(RuntimeError):
    pass


def backends_required() -> bool:
    return os.environ.get("REQUIRE_BACKENDS", "").lower() in ("1", "true", "yes")


@cache
def service_url(name: str) -> str | None:
    """The service's URL, from the environment or a fresh container; None if neither."""
    url = os.environ.get(ENV_VARS[name])
    if url:
        return url
    if _docker_available():
        return _start_container(name)
    if backends_required():
        raise BackendUnavailable(
            f"{ENV_VARS[name]} is not set and no Docker engine is available, but "
            f"REQUIRE_BACKENDS is set: start {name} and export {ENV_VARS[name]}."
        )
    return None


def _docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_container(name: str) -> str:
    container: Any
    if name == "postgresql":
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:16-alpine", driver=None).start()
        url = str(container.get_connection_url())
    elif name == "mariadb":
        from testcontainers.mysql import MySqlContainer

        container = MySqlContainer("mariadb:11", username="root", password="test").start()
        host, port = container.get_container_host_ip(), container.get_exposed_port(3306)
        url = f"mysql://root:test@{host}:{port}/test"
    elif name == "redis":
        from testcontainers.redis import RedisContainer

        container = RedisContainer("redis:7-alpine").start()
        host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
        url = f"redis://{host}:{port}/0"
    else:
        from testcontainers.rabbitmq import RabbitMqContainer

        container = RabbitMqContainer("rabbitmq:3-alpine").start()
        host, port = container.get_container_host_ip(), container.get_exposed_port(5672)
        url = f"amqp://guest:guest@{host}:{port}//"
    atexit.register(container.stop)
    os.environ[ENV_VARS[name]] = url  # child processes (test servers) reuse the same container
    return url
