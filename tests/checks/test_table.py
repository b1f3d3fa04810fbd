"""The system-check table: every row registered, and every id seen firing and seen quiet
through ``manage.py check``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from io import StringIO
from typing import Any

import pytest
from celery import Celery
from celery._state import get_current_app
from django.core.checks.registry import registry
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection, connections

from django_idempotency import checks
from django_idempotency.conf import DEFAULTS
from django_idempotency.inbox import idempotent_consumer
from django_idempotency.tasks import BEAT_SCHEDULE

# Django 6 runs the model checks against every database, and they ask it about JSON.
pytestmark = pytest.mark.django_db(databases="__all__")

MEMORY = "django_idempotency.publishers.memory.MemoryPublisher"
WEBHOOK = "django_idempotency.publishers.webhook.WebhookPublisher"
NATS = "django_idempotency.publishers.nats.NATSPublisher"
OURS = checks.MIDDLEWARE
AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"
SESSIONS = "django.contrib.sessions.middleware.SessionMiddleware"
MESSAGES = "django.contrib.messages.middleware.MessageMiddleware"
CSRF = "django.middleware.csrf.CsrfViewMiddleware"
REDIS = {
    "BACKEND": "django_redis.cache.RedisCache",
    "LOCATION": "redis://127.0.0.1:6379/2",
    "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.1, "SOCKET_TIMEOUT": 0.1},
}


@contextmanager
def current_celery_app(**conf: Any) -> Iterator[Celery]:
    """A Celery app made current for the block: what ``manage.py`` loads from a project."""
    app = Celery("checks", set_as_current=False)
    app.conf.update(conf)
    previous = get_current_app()
    app.set_current()
    try:
        yield app
    finally:
        previous.set_current()


class RecordsElsewhere:
    """A router that sends the idempotency records to another database."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "records" if model._meta.model_name == "idempotencyrecord" else None


class Project:
    """The project a check runs on: settings, patches and contexts, undone after the test."""

    def __init__(self, settings: Any, monkeypatch: pytest.MonkeyPatch, stack: ExitStack) -> None:
        self.settings = settings
        self.monkeypatch = monkeypatch
        self.stack = stack
        self.arguments: list[str] = []

    def idempotency(self, **values: Any) -> None:
        self.settings.IDEMPOTENCY = {**self.settings.IDEMPOTENCY, **values}

    def without(self, *names: str) -> None:
        current = self.settings.IDEMPOTENCY
        self.settings.IDEMPOTENCY = {k: v for k, v in current.items() if k not in names}

    def set(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self.settings, name, value)

    def missing(self, module: str) -> None:
        """Make ``module`` look not installed to the checks."""
        importable = checks.importable
        self.monkeypatch.setattr(
            checks.base, "importable", lambda name: name != module and importable(name)
        )

    def database(self, **values: Any) -> None:
        """Change the default alias's configuration as the checks read it (no connection)."""
        self.monkeypatch.setitem(
            connections.settings, "default", {**connections.settings["default"], **values}
        )

    def celery(self, **conf: Any) -> Celery:
        return self.stack.enter_context(current_celery_app(**conf))

    def consumer(self, **options: Any) -> None:
        @self.celery().task(shared=False, name="checks.consumer", **options)
        @idempotent_consumer
        def consumer() -> None:
            pass

    def check(self) -> str:
        """``manage.py check``'s whole report, errors and warnings."""
        out, err = StringIO(), StringIO()
        try:
            call_command("check", *self.arguments, stdout=out, stderr=err)
        except SystemCheckError as exc:
            return str(exc)
        return err.getvalue() + out.getvalue()


@pytest.fixture
def project(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Project]:
    with ExitStack() as stack:
        yield Project(settings, monkeypatch, stack)


def no_skip_locked(p: Project) -> None:
    p.monkeypatch.setattr(connection.features, "has_select_for_update", True)
    p.monkeypatch.setattr(connection.features, "has_select_for_update_skip_locked", False)
    p.arguments = ["--database", "default"]


def records_layout(
    p: Project,
    *,
    partitioned: bool,
    covered_days: float | None = 3,
    table: str = "records",
    **idempotency: Any,
) -> None:
    """A PostgreSQL database whose records (or outbox) table is (or is not) partitioned, with
    partitions covering ``covered_days`` ahead, the other table plain; checked with
    ``--database`` (no connection is made)."""
    from datetime import UTC, datetime, timedelta

    now = datetime(2030, 1, 1, 12, tzinfo=UTC)
    covered = None if covered_days is None else now + timedelta(days=covered_days)

    def layout(alias: str, label: str = "records") -> tuple[bool, datetime | None, datetime]:
        return (partitioned, covered, now) if label == table else (False, None, now)

    p.monkeypatch.setattr(
        checks.partitions, "_records_vendor", lambda label="records": ("default", "postgresql")
    )
    p.monkeypatch.setattr(checks.partitions, "record_layout", layout)
    p.arguments = ["--database", "default"]
    p.idempotency(**idempotency)


def default_kick(p: Project) -> None:
    p.without("OUTBOX_KICK")


def deploy(p: Project, *arguments: str) -> None:
    """``manage.py check --deploy`` (and ``arguments``)."""
    p.arguments = ["--deploy", *arguments]


def behind_pgbouncer(p: Project, **idempotency: Any) -> None:
    deploy(p)
    p.database(ENGINE="django.db.backends.postgresql", PORT="6432")
    p.idempotency(**idempotency)


def tables_missing(p: Project) -> None:
    p.monkeypatch.setattr(connection.introspection, "table_names", lambda *args, **kw: [])
    p.arguments = ["--database", "default"]


Scenario = Callable[[Project], Any]

#: For each id: a project where it fires, and the nearest project where it stays quiet.
SCENARIOS: dict[str, tuple[Scenario, Scenario]] = {
    checks.E001: (lambda p: p.set(IDEMPOTENCY=["x"]), lambda p: p.set(IDEMPOTENCY={})),
    checks.W001: (lambda p: p.idempotency(LEASE_SECONS=30), lambda p: p.idempotency()),
    checks.E002: (
        lambda p: p.idempotency(LEASE_SECONDS="thirty"),
        lambda p: p.idempotency(LEASE_SECONDS=" 30 "),
    ),
    checks.E003: (
        lambda p: p.idempotency(TTL_SECONDS=-1),
        lambda p: p.idempotency(TTL_SECONDS="86400"),
    ),
    checks.E004: (
        lambda p: p.idempotency(TTL_SECONDS=10, LEASE_SECONDS=30),
        lambda p: p.idempotency(TTL_SECONDS="30", LEASE_SECONDS=30),
    ),
    checks.E005: (
        lambda p: p.idempotency(SCOPE_RESOLVER="no.such.resolver"),
        lambda p: p.idempotency(SCOPE_RESOLVER="django_idempotency.request.scopes.user_scope"),
    ),
    checks.E006: (
        lambda p: p.idempotency(STORED_STATUS_CODES=[200, 700]),
        lambda p: p.idempotency(STORED_STATUS_CODES=[200, 201]),
    ),
    checks.E007: (
        lambda p: p.idempotency(STORED_RESPONSE_HEADERS="Content-Type"),
        lambda p: p.idempotency(STORED_RESPONSE_HEADERS=["Content-Type"]),
    ),
    checks.W002: (
        lambda p: p.idempotency(STORED_RESPONSE_HEADERS=["Content-Type", "Set-Cookie"]),
        lambda p: p.idempotency(STORED_RESPONSE_HEADERS=["Content-Type", "ETag"]),
    ),
    checks.E008: (
        lambda p: p.idempotency(MAX_RESPONSE_BYTES=1.5),
        lambda p: p.idempotency(MAX_RESPONSE_BYTES="1024"),
    ),
    checks.E009: (
        lambda p: p.idempotency(HEADER="Idempotency Key"),
        lambda p: p.idempotency(HEADER="X-Request-Key"),
    ),
    checks.E010: (
        lambda p: p.idempotency(MIDDLEWARE_PATHS=["(unclosed"]),
        lambda p: p.idempotency(MIDDLEWARE_PATHS=[r"^/api/"]),
    ),
    checks.E011: (
        lambda p: p.idempotency(KEY_REQUIRED="maybe"),
        lambda p: p.idempotency(KEY_REQUIRED=" Off "),
    ),
    checks.E012: (
        lambda p: p.idempotency(MIDDLEWARE_METHODS="POST"),
        lambda p: p.idempotency(MIDDLEWARE_METHODS=["POST"]),
    ),
    checks.E013: (
        lambda p: p.set(MIDDLEWARE=[SESSIONS, AUTH, MESSAGES, OURS, CSRF]),
        lambda p: p.set(MIDDLEWARE=[SESSIONS, CSRF, AUTH, MESSAGES, OURS, "no.such.Middleware"]),
    ),
    checks.E014: (
        lambda p: p.idempotency(CREDENTIAL_SCOPE="ignore"),
        lambda p: p.idempotency(CREDENTIAL_SCOPE="refuse"),
    ),
    checks.E015: (
        lambda p: p.idempotency(CREDENTIAL_HEADERS="Authorization"),
        lambda p: p.idempotency(CREDENTIAL_HEADERS=["Authorization", "X-Api-Key"]),
    ),
    checks.E016: (
        lambda p: p.idempotency(ATTACH_MAX_WAIT_SECONDS=-1),
        lambda p: p.idempotency(ATTACH_DEFAULT_WAIT_SECONDS="2.5", ATTACH_MAX_WAIT_SECONDS=0),
    ),
    checks.E017: (
        lambda p: p.idempotency(ATTACH_MAX_WAITERS=1.5),
        lambda p: p.idempotency(ATTACH_MAX_WAITERS="0"),
    ),
    checks.E018: (
        lambda p: p.idempotency(ATTACH_POLL_SECONDS=0),
        lambda p: p.idempotency(ATTACH_POLL_SECONDS="0.05"),
    ),
    checks.E019: (
        lambda p: p.idempotency(HANDOFF_HOLD_SECONDS=-1),
        lambda p: p.idempotency(HANDOFF_HOLD_SECONDS="900"),
    ),
    checks.W003: (
        lambda p: p.database(ENGINE="django.db.backends.sqlite3", OPTIONS={}),
        lambda p: p.database(
            ENGINE="django.db.backends.sqlite3", OPTIONS={"transaction_mode": "immediate"}
        ),
    ),
    checks.W004: (
        lambda p: p.set(MIDDLEWARE=[SESSIONS, OURS, AUTH, MESSAGES]),
        lambda p: p.set(MIDDLEWARE=[SESSIONS, AUTH, MESSAGES, OURS]),
    ),
    checks.W005: (
        lambda p: p.set(DATABASE_ROUTERS=[f"{__name__}.RecordsElsewhere"]),
        lambda p: p.set(DATABASE_ROUTERS=[]),
    ),
    checks.W006: (lambda p: p.set(USE_TZ=False), lambda p: p.set(USE_TZ=True)),
    checks.W011: (
        # Two threads per process, two waiters per scope (the default): one client holds all.
        lambda p: p.monkeypatch.setenv("GUNICORN_CMD_ARGS", "--workers 3 --threads 2"),
        lambda p: p.monkeypatch.setenv("GUNICORN_CMD_ARGS", "--workers 3 --threads 8"),
    ),
    checks.W007: (
        # The test settings: the middleware on two paths, DRF with TokenAuthentication.
        lambda p: p.idempotency(),
        lambda p: p.set(
            REST_FRAMEWORK={
                "DEFAULT_AUTHENTICATION_CLASSES": [
                    "rest_framework.authentication.SessionAuthentication"
                ]
            }
        ),
    ),
    checks.E020: (
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={"*": {"BACKEND": MEMORY, "OPTION": {}}}),
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={"*": {"BACKEND": MEMORY, "OPTIONS": {}}}),
    ),
    checks.E021: (
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={"*": "no.such.Publisher"}),
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={"*": MEMORY}),
    ),
    checks.E028: (
        lambda p: p.idempotency(
            OUTBOX_PUBLISHERS={"*": {"BACKEND": WEBHOOK, "OPTIONS": {"url": "https://x/"}}}
        ),
        lambda p: p.idempotency(
            OUTBOX_PUBLISHERS={
                "*": {"BACKEND": WEBHOOK, "OPTIONS": {"url": "https://x/", "secret": "s"}}
            }
        ),
    ),
    checks.W024: (
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={"orders.*": MEMORY}),
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={"orders.*": MEMORY, "*": MEMORY}),
    ),
    checks.E027: (
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={}, OUTBOX_KICK=DEFAULTS["OUTBOX_KICK"]),
        lambda p: p.idempotency(OUTBOX_PUBLISHERS={}, OUTBOX_KICK=None),
    ),
    checks.W025: (
        lambda p: (default_kick(p), p.missing("celery")),
        default_kick,
    ),
    checks.E022: (
        lambda p: p.idempotency(OUTBOX_BATCH_SIZE=0),
        lambda p: p.idempotency(OUTBOX_BATCH_SIZE="50"),
    ),
    checks.E023: (
        lambda p: p.idempotency(OUTBOX_POLL_SECONDS="soon"),
        lambda p: p.idempotency(OUTBOX_POLL_SECONDS="2.5"),
    ),
    checks.E024: (
        lambda p: p.idempotency(OUTBOX_BACKOFF_BASE_SECONDS=10, OUTBOX_BACKOFF_MAX_SECONDS=5),
        lambda p: p.idempotency(OUTBOX_BACKOFF_BASE_SECONDS=1, OUTBOX_BACKOFF_MAX_SECONDS=5),
    ),
    checks.E025: (
        lambda p: p.idempotency(OUTBOX_KICK="no.such.kick"),
        lambda p: p.idempotency(OUTBOX_KICK="django_idempotency.testing.relay_now"),
    ),
    checks.E026: (
        lambda p: p.idempotency(OUTBOX_NOTIFY="sometimes"),
        lambda p: p.idempotency(OUTBOX_NOTIFY="no"),
    ),
    checks.W020: (
        lambda p: (
            p.celery(broker_url="redis://localhost:6379/0"),
            p.idempotency(INBOX_RETENTION_SECONDS=600),
        ),
        lambda p: p.celery(broker_url="redis://localhost:6379/0"),
    ),
    checks.W021: (
        lambda p: p.consumer(acks_late=False),
        lambda p: p.consumer(acks_late=True, reject_on_worker_lost=True),
    ),
    checks.W026: (
        lambda p: p.idempotency(
            OUTBOX_PUBLISHERS={"*": {"BACKEND": NATS, "OPTIONS": {"servers": "nats://n:4222"}}}
        ),
        lambda p: p.idempotency(
            OUTBOX_PUBLISHERS={
                "*": {
                    "BACKEND": NATS,
                    "OPTIONS": {"servers": "nats://n:4222", "duplicate_window": 3600},
                }
            }
        ),
    ),
    checks.W022: (no_skip_locked, lambda p: setattr(p, "arguments", ["--database", "default"])),
    checks.W023: (
        lambda p: p.consumer(acks_late=True),
        lambda p: p.consumer(acks_late=True, reject_on_worker_lost=True),
    ),
    checks.E040: (
        lambda p: p.idempotency(CACHE_ALIAS="missing"),
        lambda p: p.idempotency(CACHE_ALIAS=None),
    ),
    checks.E041: (
        lambda p: (
            p.set(CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}),
            p.idempotency(CACHE_ALIAS="default"),
        ),
        lambda p: (p.set(CACHES={"default": REDIS}), p.idempotency(CACHE_ALIAS="default")),
    ),
    checks.E042: (
        lambda p: p.idempotency(CACHE_RETRY_SECONDS="-1"),
        lambda p: p.idempotency(CACHE_RETRY_SECONDS="0"),
    ),
    checks.E043: (
        lambda p: p.idempotency(LOCAL_REPLAY_SECONDS="-1"),
        lambda p: p.idempotency(LOCAL_REPLAY_SECONDS="2.5"),
    ),
    checks.E044: (
        lambda p: p.idempotency(LOCAL_REPLAY_ENTRIES=0),
        lambda p: p.idempotency(LOCAL_REPLAY_ENTRIES="500"),
    ),
    checks.W040: (
        lambda p: (
            p.set(CACHES={"default": {**REDIS, "OPTIONS": {}}}),
            p.idempotency(CACHE_ALIAS="default"),
        ),
        lambda p: (p.set(CACHES={"default": REDIS}), p.idempotency(CACHE_ALIAS="default")),
    ),
    checks.E060: (
        lambda p: p.idempotency(METRICS="sometimes"),
        lambda p: p.idempotency(METRICS="ON"),
    ),
    checks.W060: (
        lambda p: (p.missing("prometheus_client"), p.idempotency(METRICS="yes")),
        lambda p: (p.missing("prometheus_client"), p.idempotency(METRICS="no")),
    ),
    checks.W061: (
        lambda p: (p.missing("opentelemetry.trace"), p.idempotency(TRACING=True)),
        lambda p: p.idempotency(TRACING=True),
    ),
    checks.E080: (
        lambda p: p.idempotency(RECORD_PARTITIONS="maybe"),
        lambda p: p.idempotency(RECORD_PARTITIONS="off"),
    ),
    checks.E081: (
        lambda p: p.idempotency(PARTITION_SPAN_DAYS=0),
        lambda p: p.idempotency(PARTITION_SPAN_DAYS="7", PARTITION_AHEAD_DAYS=14),
    ),
    checks.E082: (
        lambda p: (
            p.monkeypatch.setattr(
                checks.partitions, "_records_vendor", lambda label="records": ("default", "sqlite")
            ),
            p.idempotency(RECORD_PARTITIONS=True),
        ),
        lambda p: (
            p.monkeypatch.setattr(
                checks.partitions, "_records_vendor", lambda label="records": ("default", "sqlite")
            ),
            p.idempotency(RECORD_PARTITIONS=False),
        ),
    ),
    checks.E083: (
        lambda p: records_layout(p, partitioned=True, RECORD_PARTITIONS=False),
        lambda p: records_layout(p, partitioned=True, RECORD_PARTITIONS=True),
    ),
    checks.W080: (
        lambda p: records_layout(p, partitioned=False, RECORD_PARTITIONS=True),
        lambda p: records_layout(p, partitioned=False, RECORD_PARTITIONS=False),
    ),
    checks.W081: (
        lambda p: records_layout(p, partitioned=True, covered_days=0.5, RECORD_PARTITIONS=True),
        lambda p: records_layout(p, partitioned=True, covered_days=3, RECORD_PARTITIONS=True),
    ),
    checks.E084: (tables_missing, lambda p: setattr(p, "arguments", ["--database", "default"])),
    # The deploy checks: the test settings guard DRF views open to anonymous clients.
    checks.W008: (
        deploy,
        lambda p: (deploy(p), p.idempotency(SCOPE_RESOLVER=f"{__name__}.tenant_scope")),
    ),
    checks.W009: (
        behind_pgbouncer,
        lambda p: behind_pgbouncer(p, PREPARED_STATEMENTS=False, TAKE_OVER_DEAD_OWNERS="off"),
    ),
    checks.W010: (
        lambda p: (deploy(p), p.idempotency(TTL_SECONDS=3600)),
        lambda p: (deploy(p), p.idempotency(TTL_SECONDS="86400")),
    ),
    checks.W027: (
        lambda p: (deploy(p), default_kick(p), p.celery(broker_url="redis://r:6379/0")),
        lambda p: (
            deploy(p),
            default_kick(p),
            p.celery(
                broker_url="redis://r:6379/0",
                broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 5},
            ),
        ),
    ),
    checks.W041: (
        lambda p: (deploy(p), p.idempotency(LOCAL_REPLAY_SECONDS="2")),
        lambda p: (deploy(p), p.idempotency(LOCAL_REPLAY_SECONDS=0)),
    ),
    checks.W062: (
        lambda p: (deploy(p), p.celery(beat_schedule={"mine": {"task": "x", "schedule": 60}})),
        lambda p: (deploy(p), p.celery(beat_schedule=BEAT_SCHEDULE)),
    ),
}


def reported(report: str) -> set[str]:
    return set(re.findall(r"django_idempotency\.[EW]\d{3}", report))


@pytest.mark.parametrize("check_id", sorted(SCENARIOS))
def test_each_check_fires_through_manage_py_check(project: Project, check_id: str) -> None:
    fire, _ = SCENARIOS[check_id]
    fire(project)
    report = project.check()
    assert check_id in reported(report), report


@pytest.mark.parametrize("check_id", sorted(SCENARIOS))
def test_each_check_is_quiet_when_the_project_is_right(project: Project, check_id: str) -> None:
    _, quiet = SCENARIOS[check_id]
    quiet(project)
    report = project.check()
    assert check_id not in reported(report), report


def test_every_declared_check_has_its_scenarios() -> None:
    assert set(SCENARIOS) == set(checks.BY_ID)


def test_every_declared_check_is_registered_with_django() -> None:
    registered = registry.get_checks(include_deployment_checks=True)
    assert [check.id for check in checks.CHECKS if check not in registered] == []
    for check in checks.CHECKS:
        assert tuple(check.tags) == tuple(getattr(check, "tags", ()))


def test_the_deploy_checks_run_only_with_deploy() -> None:
    always = registry.get_checks()
    assert {check.id for check in checks.CHECKS if check not in always} == {
        check.id for check in checks.DEPLOY_CHECKS
    }
    assert all(check.deploy for check in checks.DEPLOY_CHECKS)


@pytest.mark.parametrize("check_id", sorted(check.id for check in checks.DEPLOY_CHECKS))
def test_a_deploy_check_is_quiet_in_plain_check(project: Project, check_id: str) -> None:
    fire, _ = SCENARIOS[check_id]
    fire(project)
    project.arguments = [argument for argument in project.arguments if argument != "--deploy"]
    assert check_id not in reported(project.check())


def test_every_deploy_check_hint_names_a_fix() -> None:
    for check in checks.DEPLOY_CHECKS:
        assert check.hint and re.search(r"\b(Set|Run|Merge|Require|With)\b", check.hint), check.id


def test_the_table_holds_every_id_once() -> None:
    constants = {
        value
        for name, value in vars(checks).items()
        if re.fullmatch(r"[EW]\d{3}", name) and isinstance(value, str)
    }
    ids = [check.id for check in checks.CHECKS]
    assert len(ids) == len(set(ids))
    assert set(ids) == constants


def test_errors_are_errors_and_warnings_warnings(project: Project) -> None:
    project.idempotency(LEASE_SECONDS=0, LEASE_SECONS=1)
    messages = {message.id: message for message in checks.check_settings()}
    assert messages[checks.E002].is_serious()
    assert not messages[checks.W001].is_serious()


def test_an_error_fails_manage_py_check(project: Project) -> None:
    project.idempotency(TTL_SECONDS=1, LEASE_SECONDS=30)
    with pytest.raises(SystemCheckError, match="django_idempotency.E004"):
        call_command("check")


def test_not_a_dict_stops_the_other_settings_checks(project: Project) -> None:
    project.set(IDEMPOTENCY=["not", "a", "dict"])
    assert reported(project.check()) >= {checks.E001}
    assert [message.id for message in checks.check_settings()] == [checks.E001]


def test_the_partition_checks_name_the_outbox_and_inbox_tables(
    project: Project, monkeypatch
) -> None:
    """E082, E083, W080 and W081 speak of any partitioned table: here the outbox and inbox."""
    project.idempotency(OUTBOX_PARTITIONS="maybe")
    assert checks.E080 in reported(project.check())
    for fire, (check_id, text) in {
        lambda p: records_layout(p, partitioned=True, table="outbox", OUTBOX_PARTITIONS=False): (
            checks.E083,
            "IDEMPOTENCY['OUTBOX_PARTITIONS'] is off: publish() with a given event_id",
        ),
        lambda p: records_layout(p, partitioned=False, table="outbox", OUTBOX_PARTITIONS=True): (
            checks.W080,
            "idempotency_partitions partition --table outbox",
        ),
        lambda p: records_layout(
            p, partitioned=True, covered_days=0.5, table="outbox", OUTBOX_PARTITIONS=True
        ): (checks.W081, "create --table outbox` now"),
    }.items():
        with pytest.MonkeyPatch.context() as patch:
            project.monkeypatch = patch
            fire(project)
            report = project.check()
        assert reported(report) & {checks.E083, checks.W080, checks.W081} == {check_id}, report
        assert text in " ".join(report.split()), report
    project.monkeypatch = monkeypatch  # the test's own again, undone after it
    records_layout(project, partitioned=True, table="inbox", INBOX_PARTITIONS=False)
    report = " ".join(project.check().split())
    assert "The inbox table in database 'default' is partitioned" in report
    assert "unpartition --table inbox" in report
    monkeypatch.setattr(
        checks.partitions, "_records_vendor", lambda label="records": ("default", "mysql")
    )
    project.idempotency(OUTBOX_PARTITIONS=True)
    assert "the outbox database 'default' is 'mysql'" in project.check()


def test_sqlite_warning_needs_no_database_connection(project: Project, monkeypatch) -> None:
    """Plain ``manage.py check`` and ``runserver`` show W003: it reads ENGINE and OPTIONS."""
    project.database(ENGINE="django.db.backends.sqlite3", OPTIONS={"timeout": 20})
    project.set(DEBUG=True)  # startproject's default, where the issue was found

    def no_connecting(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the check connected to the database")

    monkeypatch.setattr(connection, "ensure_connection", no_connecting)
    messages = checks.BY_ID[checks.W003]()
    assert [message.id for message in messages] == [checks.W003]
    assert "'transaction_mode': 'IMMEDIATE'" in messages[0].hint
    assert "database is locked" in messages[0].msg


def test_view_middleware_after_ours_is_named(project: Project) -> None:
    project.set(
        MIDDLEWARE=[SESSIONS, AUTH, OURS, CSRF, "django.middleware.common.CommonMiddleware"]
    )
    messages = checks.BY_ID[checks.E013]()
    assert [message.msg.split()[0] for message in messages] == [CSRF]  # Common has none
    assert "last" in messages[0].hint


def test_credentials_warning_names_the_classes_and_respects_its_conditions(
    project: Project,
) -> None:
    warning = checks.BY_ID[checks.W007]
    [message] = warning()
    assert "rest_framework.authentication.TokenAuthentication" in message.msg
    assert "SessionAuthentication" not in message.msg
    project.idempotency(CREDENTIAL_SCOPE="refuse")
    assert warning() == []
    project.idempotency(CREDENTIAL_SCOPE="digest", SCOPE_RESOLVER=f"{__name__}.tenant_scope")
    assert warning() == []
    project.idempotency(SCOPE_RESOLVER=DEFAULTS["SCOPE_RESOLVER"], MIDDLEWARE_PATHS=[])
    assert warning() == []
    project.idempotency(MIDDLEWARE_PATHS=[r"^/api/"])
    project.set(MIDDLEWARE=[SESSIONS, AUTH])
    assert warning() == []
    project.set(MIDDLEWARE=[SESSIONS, AUTH, OURS], REST_FRAMEWORK={})
    # DRF's own default authenticates with Basic too.
    assert "BasicAuthentication" in warning()[0].msg


@pytest.mark.parametrize(
    ("arguments", "threads"),
    [
        ("", None),
        ("--threads 4", 4),
        ("-w 2", 1),
        ("-k gthread --threads=6", 6),
        ("-k gevent", None),
    ],
)
def test_the_servers_threads_are_read_as_gunicorn_reads_them(
    monkeypatch: pytest.MonkeyPatch, arguments: str, threads: int | None
) -> None:
    monkeypatch.setenv("GUNICORN_CMD_ARGS", arguments)
    known = checks.server_threads()
    assert (known[0] if known else None) == threads


def tenant_scope(request: Any) -> str:
    return "tenant"


def test_an_explicit_default_kick_without_publishers_is_an_error(project: Project) -> None:
    """The default kick left alone is no error: a project that never publishes passes."""
    project.idempotency(OUTBOX_PUBLISHERS={})
    project.without("OUTBOX_KICK")
    report = reported(project.check())
    assert checks.E027 not in report and checks.W024 in report


def test_catch_all_warning_lists_the_patterns(project: Project) -> None:
    project.idempotency(OUTBOX_PUBLISHERS={"orders.*": MEMORY, "invoices.sent": MEMORY})
    [message] = checks.BY_ID[checks.W024]()
    assert "'orders.*', 'invoices.sent'" in message.msg and "UnroutableTopic" in message.msg
