"""docker-compose.yml: a valid file, healthy services, and commands that really run.

There is no Docker engine here, so the services run as plain processes with the commands and
healthchecks written in the file, against this machine's RabbitMQ.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from django_idempotency.tasks import BEAT_SCHEDULE
from tests.conftest import require_service
from tests.demo import stack
from tests.settings import TEST_DATABASE
from tests.support.backends import backends_required

APP_SERVICES = ("setup", "web", "worker", "beat")
#: The process tests need RabbitMQ and not the suite's database: run them in one pass only.
only_once = pytest.mark.skipif(
    TEST_DATABASE != "postgresql", reason="runs in the PostgreSQL pass, the stack's database"
)


def test_the_file_is_valid_compose() -> None:
    client = stack.compose_client()
    if client is None:
        if backends_required():
            pytest.fail("neither `docker compose` nor `docker-compose` is installed")
        pytest.skip("no compose client installed")
    result = subprocess.run(
        [*client, "--file", str(stack.COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        cwd=stack.ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_every_service_has_a_healthcheck() -> None:
    services = stack.compose()["services"]
    assert set(services) == {"db", "redis", "rabbitmq", *APP_SERVICES}
    for name, service in services.items():
        if name != "setup":  # runs once and exits; the others wait for it to succeed
            assert service["healthcheck"]["test"], name


def test_the_app_services_share_one_environment() -> None:
    services = stack.compose()["services"]
    environments = [services[name]["environment"] for name in APP_SERVICES]
    shared = {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "DEMO_FAULTS"}
    for environment in environments:
        assert shared <= set(environment)
        assert {name: environment[name] for name in shared} == {
            name: environments[0][name] for name in shared
        }


def demo_settings(**variables: str) -> dict[str, Any]:
    """What demo_project.settings makes of these variables, read in a fresh interpreter."""
    script = (
        "import json, demo_project.settings as s; print(json.dumps({"
        "'engine': s.DATABASES['default']['ENGINE'], 'caches': s.CACHES, "
        "'idempotency': s.IDEMPOTENCY, 'eager': s.CELERY_TASK_ALWAYS_EAGER, "
        "'broker': s.CELERY_BROKER_URL, 'faults': s.DEMO_FAULTS, "
        "'beat': s.CELERY_BEAT_SCHEDULE}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=stack.environment(**variables),
        cwd=stack.ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    loaded: dict[str, Any] = json.loads(result.stdout)
    return loaded


def test_the_settings_understand_the_stacks_variables() -> None:
    compose_environment = stack.compose()["services"]["web"]["environment"]
    configured = demo_settings(**{name: str(value) for name, value in compose_environment.items()})
    assert configured["engine"] == "django.db.backends.postgresql"
    assert configured["caches"]["idempotency"]["BACKEND"] == "django_redis.cache.RedisCache"
    assert configured["caches"]["idempotency"]["LOCATION"] == "redis://redis:6379/0"
    assert configured["idempotency"]["CACHE_ALIAS"] == "idempotency"
    assert configured["idempotency"]["LEASE_SECONDS"] == 5
    assert configured["eager"] is False
    assert configured["broker"] == "amqp://guest:guest@rabbitmq:5672//"
    assert configured["faults"] is True
    # The events go to the broker as the ledger tasks, and beat relays and sweeps.
    publishers = configured["idempotency"]["OUTBOX_PUBLISHERS"]
    assert publishers["payment.completed"] == {
        "BACKEND": "django_idempotency.publishers.celery.CeleryPublisher",
        "OPTIONS": {
            "app": "demo_project.celery.app",
            "task": "demo_project.payments.tasks.record_payment",
        },
    }
    assert publishers["payment.refunded"]["OPTIONS"]["task"] == (
        "demo_project.payments.tasks.record_refund"
    )
    assert configured["beat"] == json.loads(json.dumps(BEAT_SCHEDULE))


def test_without_variables_the_demo_needs_nothing_but_python() -> None:
    configured = demo_settings()
    assert configured["engine"] == "django.db.backends.sqlite3"
    assert "idempotency" not in configured["caches"]
    assert "CACHE_ALIAS" not in configured["idempotency"]
    assert configured["eager"] is True
    assert configured["faults"] is False
    # The relay and the ledger consumer run in the web process.
    publishers = configured["idempotency"]["OUTBOX_PUBLISHERS"]
    assert {route["BACKEND"] for route in publishers.values()} == {
        "demo_project.payments.inprocess.InProcessTaskPublisher"
    }
    assert configured["idempotency"]["OUTBOX_KICK"] == "django_idempotency.tasks.kick_relay"


@only_once
def test_the_worker_runs_and_its_healthcheck_tells_when_it_stops(tmp_path: Path) -> None:
    amqp_url = require_service("amqp")
    name = f"demo-test-{uuid.uuid4().hex[:12]}"
    env = stack.environment(
        CELERY_BROKER_URL=amqp_url,
        # Our own queue, so this worker never takes a task meant for anyone else on the broker,
        # and our own node name, as the container's hostname gives it in compose.
        CELERY_TASK_DEFAULT_QUEUE=name,
        HOSTNAME=name,
        CELERY_WORKER_HOSTNAME=f"celery@{name}",
    )
    try:
        log = tmp_path / "worker.log"
        with stack.running(stack.command("worker"), env, stack.ROOT, log) as worker:
            stack.wait_for_worker(worker, log, env, stack.ROOT)
        assert not stack.healthy("worker", env, stack.ROOT)
    finally:
        stack.delete_queue(amqp_url, name)


@only_once
def test_beat_runs_and_its_healthcheck_tells_when_it_stops(tmp_path: Path) -> None:
    amqp_url = require_service("amqp")
    name = f"demo-test-{uuid.uuid4().hex[:12]}"
    # Beat sends the outbox relay every 10 s: to a queue of our own, deleted afterwards.
    env = stack.environment(CELERY_BROKER_URL=amqp_url, CELERY_TASK_DEFAULT_QUEUE=name)
    workdir = tmp_path / "beat"  # compose gives beat a fresh /tmp as its working directory
    workdir.mkdir()
    try:
        with stack.running(stack.command("beat"), env, workdir, tmp_path / "beat.log"):
            stack.wait_for(lambda: stack.healthy("beat", env, workdir), "beat's healthcheck")
        assert not stack.healthy("beat", env, workdir)
    finally:
        stack.delete_queue(amqp_url, name)
