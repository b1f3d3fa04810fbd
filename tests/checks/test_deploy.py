"""The deploy checks beyond their scenarios in ``tests/checks/test_table.py``: what each one looks
at, including what ``--database`` lets it see in the tables."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_idempotency import checks
from django_idempotency.models import IdempotencyRecord, ProcessedMessage
from tests.checks.test_table import Project, reported
from tests.support.factories import IdempotencyRecordFactory, OutboxEventFactory

pytestmark = pytest.mark.django_db(databases="__all__")

CELERY_PUBLISHER = "django_idempotency.publishers.celery.CeleryPublisher"


@pytest.fixture
def project(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Project]:
    with ExitStack() as stack:
        yield Project(settings, monkeypatch, stack)


def messages(project: Project, check_id: str) -> list[str]:
    """The lines of ``check_id`` in the report."""
    return [line for line in project.check().splitlines() if check_id in line]


# --- W008: the shared anonymous scope ----------------------------------------------------------


def test_anonymous_scope_names_the_views_that_let_anonymous_clients_in(project: Project) -> None:
    project.arguments = ["--deploy"]
    (line,) = messages(project, checks.W008)
    assert "tests.testapp.views.WidgetViewSet" in line


def test_anonymous_scope_in_the_records_table(project: Project) -> None:
    project.monkeypatch.setattr(checks.deploy, "_anonymous_mixin_views", list)
    project.arguments = ["--deploy", "--database", "default"]
    assert checks.W008 not in reported(project.check())
    IdempotencyRecordFactory(scope="anonymous")
    (line,) = messages(project, checks.W008)
    assert "database 'default' holds keys sent anonymously" in line
    # Without --database nothing is read.
    project.arguments = ["--deploy"]
    assert checks.W008 not in reported(project.check())


# --- W009: a transaction-mode pooler -----------------------------------------------------------


@pytest.mark.parametrize(
    ("database", "evidence"),
    [
        ({"DISABLE_SERVER_SIDE_CURSORS": True}, "DISABLE_SERVER_SIDE_CURSORS is True"),
        ({"PORT": 6432}, "PORT is 6432"),
        ({"HOST": "pgbouncer.internal"}, "HOST names PgBouncer"),
    ],
)
def test_a_pooler_is_told_from_the_settings(
    project: Project, database: dict[str, Any], evidence: str
) -> None:
    project.arguments = ["--deploy"]
    project.database(ENGINE="django.db.backends.postgresql", **database)
    project.idempotency(TAKE_OVER_DEAD_OWNERS=False)
    (line,) = messages(project, checks.W009)
    assert evidence in line
    assert "PREPARED_STATEMENTS use session state" in line


def test_no_pooler_no_warning(project: Project) -> None:
    project.arguments = ["--deploy"]
    project.database(ENGINE="django.db.backends.postgresql", PORT="5432", HOST="db")
    assert checks.W009 not in reported(project.check())


# --- W027: the outbox's Redis broker -----------------------------------------------------------


def test_a_celery_publisher_routes_app_is_checked(project: Project) -> None:
    project.arguments = ["--deploy"]
    project.idempotency(
        OUTBOX_KICK=None,
        OUTBOX_PUBLISHERS={
            "*": {"BACKEND": CELERY_PUBLISHER, "OPTIONS": {"app": "tests.checks.test_deploy.APP"}}
        },
    )
    (line,) = messages(project, checks.W027)
    assert "'deploy-checks'" in line
    assert "socket_connect_timeout" in line


def test_an_amqp_broker_needs_no_socket_timeout(project: Project) -> None:
    project.arguments = ["--deploy"]
    project.without("OUTBOX_KICK")
    project.celery(broker_url="amqp://guest@r//")
    assert checks.W027 not in reported(project.check())


# --- W062: the sweeps ---------------------------------------------------------------------------


def test_a_beat_schedule_without_the_sweeps_names_them(project: Project) -> None:
    project.arguments = ["--deploy"]
    project.celery(beat_schedule={"mine": {"task": "x", "schedule": 60}})
    (line,) = messages(project, checks.W062)
    assert "sweep_idempotency_records, sweep_outbox_events, sweep_processed_messages" in line


def test_with_partitions_the_partition_task_is_asked_for(project: Project) -> None:
    from django_idempotency.tasks import BEAT_SCHEDULE

    project.arguments = ["--deploy"]
    schedule = {
        name: entry for name, entry in BEAT_SCHEDULE.items() if "record-partitions" not in name
    }
    project.celery(beat_schedule=schedule)
    assert checks.W062 not in reported(project.check())
    project.monkeypatch.setattr(checks.deploy, "_overdue_rows", lambda c: iter(()))
    project.idempotency(RECORD_PARTITIONS=True)
    (line,) = messages(project, checks.W062)
    assert "maintain_record_partitions" in line


@pytest.mark.parametrize("table", ["records", "outbox", "inbox"])
def test_rows_a_day_past_their_sweep_say_no_sweep_runs(project: Project, table: str) -> None:
    """Without a beat schedule (cron, or nothing) the tables tell, with ``--database``."""
    project.arguments = ["--deploy", "--database", "default"]
    project.celery()
    assert checks.W062 not in reported(project.check())
    now = timezone.now()
    if table == "records":
        IdempotencyRecordFactory(expires_at=now - timedelta(hours=12))
        assert checks.W062 not in reported(project.check())  # swept hourly: not overdue yet
        IdempotencyRecord.objects.update(expires_at=now - timedelta(days=2))
    elif table == "outbox":
        OutboxEventFactory(published=True, published_at=now - timedelta(days=9))
    else:
        ProcessedMessage.objects.create(
            consumer="c", message_id="m", processed_at=now - timedelta(days=16)
        )
    (line,) = messages(project, checks.W062)
    assert f"the {table} table of database 'default' holds rows more than a day past" in line


def _app() -> Any:
    from celery import Celery

    app = Celery("deploy-checks", set_as_current=False)
    app.conf.broker_url = "rediss://r:6380/0"
    return app


APP = _app()
