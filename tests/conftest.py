from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.conf import settings
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.request import redis_copy
from tests.support.backends import backends_required, service_url
from tests.support.redis_cluster import LocalRedisCluster
from tests.testapp import views

# No time limit per example: on a shared 2-core machine a database round trip may take longer
# than hypothesis's default 200 ms for reasons that have nothing to do with the code under test.
hypothesis_settings.register_profile("shared-machine", deadline=None)
hypothesis_settings.load_profile("shared-machine")


#: Test modules whose outcome does not depend on the database backend: settings, checks, parsing,
#: publishers, clients, the docs, packaging. ``make test`` runs them in its PostgreSQL pass (and
#: its Django 6 pass) only; the other backends' passes deselect them (``-m "not once"``). Each
#: entry is a module or a whole package, named from ``tests/`` (``checks`` is tests/checks/).
ONCE = frozenset(
    {
        "checks", "demo", "project",
        "admin.test_browser",
        "core.test_failures",
        "inbox.test_webhooks_providers",
        "observability.test_metrics_multiprocess", "observability.test_tracing",
        "operations.test_tasks_celery_beat", "operations.test_tasks_without_celery",
        "operations.test_verify",
        "outbox.test_publishers", "outbox.test_publishers_nats",
        "outbox.test_publishers_route_secrets", "outbox.test_publishers_webhook_signatures",
        "outbox.test_publishers_webhook_standard",
        "request.test_client", "request.test_decorators_csrf", "request.test_drf_browsable",
        "request.test_drf_openapi", "request.test_fingerprint",
        "request.test_fingerprint_body_bounds", "request.test_keys", "request.test_keys_message",
        "request.test_redis_cluster",
    }
)  # fmt: skip


#: Of those, the ones that meet Django itself (its check framework, settings, admin, CSRF, DRF's
#: schema and browsable API): ``make test``'s Django 6 pass runs them too (``django_series``).
DJANGO_SERIES = frozenset(
    {
        "checks",
        "admin.test_browser",
        "operations.test_tasks_without_celery",
        "request.test_decorators_csrf", "request.test_drf_browsable", "request.test_drf_openapi",
    }
)  # fmt: skip


def listed(module: str, names: frozenset[str]) -> bool:
    """Whether ``tests.<module>`` is one of ``names`` or inside a package that is."""
    name = module.removeprefix("tests.")
    return any(name == entry or name.startswith(f"{entry}.") for entry in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        if listed(module, ONCE):
            item.add_marker(pytest.mark.once)
        if listed(module, DJANGO_SERIES):
            item.add_marker(pytest.mark.django_series)


#: Seconds one xdist worker spends in each test module of ``make test``'s reference pass
#: (PostgreSQL, ``pytest -n 2 --dist loadfile``, measured on a 2-core machine), for the modules
#: of 15 s or more. Rough figures order well enough; update one when its module changes a lot.
#: See ``LongestFirst``.
SECONDS = {
    "project.test_howtos": 85, "operations.test_verify": 57,
    "operations.test_tasks_celery_beat": 69, "outbox.test_partitions": 52,
    "operations.test_partitions": 51, "demo.test_tour": 44,
    "request.test_idempotent_function_celery": 39, "request.test_attach": 39,
    "project.test_packaging": 36, "request.test_redis_copy": 30,
    "request.test_lifecycle_run_step": 25, "demo.test_broker": 19,
    "demo.test_schemathesis": 22, "admin.test_browser": 20, "outbox.test_e2e": 19,
    "outbox.test_relay": 18, "request.test_middleware_decorators": 18,
    "request.test_lifecycle_doors": 17, "request.test_lifecycle": 17,
}  # fmt: skip


class LongestFirst:
    """Hands xdist the test files longest first (``SECONDS``), the others after them by their
    number of tests (xdist's own order, which this replaces: ``--loadscope-reorder`` is turned
    off). xdist's order alone starts the files with one or two long tests (the how-tos, beat,
    packaging, the demo's tour) last, where each keeps one worker busy for a minute or more after
    the others have run out of work: the pass's tail. Started first, they overlap the short files.
    Only the order changes; the tests of a file stay together and in their order."""

    @pytest.hookimpl(trylast=True)  # after ``-m`` deselected what this run does not run
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        files: dict[str, list[pytest.Item]] = {}
        for item in items:
            files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

        def cost(tests: list[pytest.Item]) -> tuple[int, int]:
            module = getattr(tests[0], "module", None)  # None for items that are no functions
            name = module.__name__.removeprefix("tests.") if module is not None else ""
            return (-SECONDS.get(name, 0), -len(tests))

        items[:] = [item for tests in sorted(files.values(), key=cost) for item in tests]


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order given
        config.option.loadscopereorder = False
    config.pluginmanager.register(LongestFirst(), "longest-first")


def pytest_report_header(config: pytest.Config) -> str:
    database = settings.DATABASES["default"]
    header = f"database: {database['ENGINE']} {database.get('HOST') or database['NAME']}"
    if getattr(settings, "PARTITIONED_TABLES", None):
        header += f"\npartitioned by day: {', '.join(settings.PARTITIONED_TABLES)}"
    return header


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix() -> None:
    """Each xdist worker has its own databases already (``tests/settings.py`` names them), under
    the very names the processes a test starts are told: pytest-django's suffix would differ."""


def require_service(name: str) -> str:
    """The service's URL, or skip (fail under REQUIRE_BACKENDS, see tests/support/backends.py)."""
    url = service_url(name)
    if url is None:
        pytest.skip(f"{name} is not available")
    return url


@pytest.fixture
def redis_url() -> str:
    return require_service("redis")


#: The runs (``TEST_DATABASE``) that start a local Redis Cluster. The Redis copy never touches the
#: database, and the database's own answers under it are tested on every backend with the
#: standalone Redis; SQLite (what a fresh clone runs) and PostgreSQL (the reference) are enough
#: for the cluster's, and MariaDB's run is spared the cluster's start-up and failovers.
CLUSTER_RUNS = ("sqlite", "postgresql")


@dataclass(frozen=True)
class RedisClusterService:
    url: str
    #: The cluster this run started (and may fail over), or None for ``REDIS_CLUSTER_URL``'s.
    local: LocalRedisCluster | None


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterService]:
    """``REDIS_CLUSTER_URL``'s cluster, or three masters and three replicas started for this
    run (on the runs of ``CLUSTER_RUNS``) and removed at its end, whatever happened."""
    url = os.environ.get("REDIS_CLUSTER_URL")
    if url:
        yield RedisClusterService(url, None)
        return
    database = os.environ.get("TEST_DATABASE", "sqlite")
    if database not in CLUSTER_RUNS:
        pytest.skip(f"the Redis Cluster tests run with TEST_DATABASE in {CLUSTER_RUNS}")
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if backends_required():
            pytest.fail("REQUIRE_BACKENDS is set but redis-server or redis-cli is missing")
        pytest.skip("redis-server and redis-cli are needed to start a Redis Cluster")
    cluster = LocalRedisCluster.start()
    try:
        yield RedisClusterService(cluster.url, cluster)
    finally:
        cluster.close()


@pytest.fixture
def amqp_url() -> str:
    return require_service("amqp")


@pytest.fixture(autouse=True)
def redis_copy_awake() -> Iterator[None]:
    """A Redis error in one test must not leave the Redis copy resting in the next."""
    redis_copy._resting_until.clear()
    yield
    redis_copy._resting_until.clear()


ON_POSTGRESQL = settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


@pytest.fixture(params=["native", "portable"] if ON_POSTGRESQL else ["native"])
def claim_path(request: Any, monkeypatch: Any) -> str:
    """On PostgreSQL, run a test through the one-statement claim and through the portable one."""
    from django_idempotency.request import claims

    if request.param == "portable":
        monkeypatch.setattr(claims, "_claim_postgresql", claims._claim_portable)
    return str(request.param)


@pytest.fixture
def client() -> APIClient:
    return APIClient()


@pytest.fixture
def key() -> str:
    return f"key-{uuid.uuid4()}"


@pytest.fixture
def gate() -> Iterator[Any]:
    """Hold a named view inside its transaction until the test opens the gate."""
    import threading

    names: list[str] = []

    def make(name: str) -> tuple[threading.Event, threading.Event]:
        names.append(name)
        views.gates[name] = threading.Event()
        views.started[name] = threading.Event()
        return views.started[name], views.gates[name]

    yield make
    for name in names:
        views.gates.pop(name).set()
        views.started.pop(name, None)


@pytest.fixture(scope="session", autouse=True)
def tables_partitioned(request: pytest.FixtureRequest) -> Iterator[None]:
    """With ``IDEMPOTENCY_TEST_PARTITIONED`` (tests/settings.py), those tables are partitioned
    for the whole run, their first partition starting 20 s into it: the run's rows land on both
    sides of a partition boundary."""
    labels = getattr(settings, "PARTITIONED_TABLES", [])
    if not labels:
        yield
        return
    from datetime import timedelta

    from django_idempotency.db import database_now
    from django_idempotency.operations import partitions

    request.getfixturevalue("django_db_setup")  # only then: other runs may need no database
    with request.getfixturevalue("django_db_blocker").unblock():
        bound = database_now("default") + timedelta(seconds=20)
        for label in labels:
            partitions.partition_table(bound=bound, layout=partitions.LAYOUTS[label])
    yield
    with request.getfixturevalue("django_db_blocker").unblock():
        # Still partitioned at the end: no test moved a table back under the others.
        assert all(partitions.is_partitioned(layout=partitions.LAYOUTS[label]) for label in labels)


@pytest.fixture
def idempotency_settings(settings: Any) -> Any:
    """Change some IDEMPOTENCY settings for one test, keeping the others."""

    def update(**values: Any) -> None:
        settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, **values}

    return update


@pytest.fixture
def released():
    """The ``key_released`` signals sent while the test runs: (scope, key, reason)."""
    seen: list[tuple[str, str, str]] = []

    def receiver(sender, *, scope, key, reason, **kwargs):
        seen.append((scope, key, reason))

    signals.key_released.connect(receiver)
    yield seen
    signals.key_released.disconnect(receiver)


@pytest.fixture(scope="session")
def span_exporter() -> Any:
    """One in-memory exporter for the whole run: the global tracer provider can be set once."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


@pytest.fixture
def spans(span_exporter: Any) -> Iterator[Any]:
    """The exporter, emptied before and after the test: ``spans.get_finished_spans()``."""
    span_exporter.clear()
    yield span_exporter
    span_exporter.clear()


@pytest.fixture
def tracer(span_exporter: Any) -> Any:
    from opentelemetry import trace

    return trace.get_tracer("tests")
