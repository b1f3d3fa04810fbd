"""The outbox and consumer rows of the check table, one by one (the table's own test runs each
through ``manage.py check``)."""

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection

from django_idempotency import checks
from django_idempotency.inbox import idempotent_consumer
from tests.checks.test_table import current_celery_app
from tests.support.outbox_support import settings_with

CONSUMER_CHECKS = (checks.W020, checks.W021, checks.W023)


def ids(messages):
    return sorted(message.id for message in messages)


def run(*check_ids, databases=None):
    return [
        message for check_id in check_ids for message in checks.BY_ID[check_id](databases=databases)
    ]


def outbox_rows():
    return [check.id for check in checks.OUTBOX_CHECKS if check.id not in CONSUMER_CHECKS]


def outbox_check(**values):
    with settings_with(**values):
        return run(*outbox_rows())


def check_consumers():
    return run(*CONSUMER_CHECKS)


def test_defaults_pass():
    assert outbox_check() == []
    assert check_consumers() == []


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"OUTBOX_PUBLISHERS": ["*"]}, [checks.E020]),
        ({"OUTBOX_PUBLISHERS": {"*": {"OPTIONS": {}}}}, [checks.E020]),
        ({"OUTBOX_PUBLISHERS": {"*": "no.such.Publisher"}}, [checks.E021]),
        ({"OUTBOX_PUBLISHERS": {"*": "django_idempotency.conf.conf"}}, [checks.E021]),
        ({"OUTBOX_BATCH_SIZE": 0}, [checks.E022]),
        ({"OUTBOX_MAX_ATTEMPTS": "three"}, [checks.E022]),
        ({"OUTBOX_MAX_ATTEMPTS": "2.5"}, [checks.E022]),
        ({"SWEEP_BATCH_SIZE": 1.5}, [checks.E022]),
        ({"OUTBOX_RELAY_LEASE_SECONDS": -1}, [checks.E023]),
        ({"INBOX_RETENTION_SECONDS": None}, [checks.E023]),
        ({"OUTBOX_BACKOFF_BASE_SECONDS": 10, "OUTBOX_BACKOFF_MAX_SECONDS": 5}, [checks.E024]),
        ({"OUTBOX_KICK": "no.such.kick"}, [checks.E025]),
        ({"OUTBOX_KICK": "django_idempotency.conf.DEFAULTS"}, [checks.E025]),
        ({"OUTBOX_REQUIRE_ATOMIC": "sure"}, [checks.E026]),
        ({"OUTBOX_NOTIFY": 2}, [checks.E026]),
        (
            {
                "OUTBOX_PUBLISHERS": {
                    "orders.*": "django_idempotency.publishers.log.LoggingPublisher"
                }
            },
            [checks.W024],
        ),
        (
            {"OUTBOX_PUBLISHERS": {}, "OUTBOX_KICK": "django_idempotency.testing.relay_now"},
            [checks.E027, checks.W024],
        ),
        (
            {
                "OUTBOX_PUBLISHERS": {
                    "*": {
                        "BACKEND": "django_idempotency.publishers.amqp.AMQPPublisher",
                        "OPTIONS": {"url": "amqp://", "exchange": "x", "confirm_timout": 1},
                    }
                }
            },
            [checks.E028],
        ),
    ],
)
def test_each_bad_setting_has_its_id(values, expected):
    assert ids(outbox_check(**values)) == expected


def test_not_a_dict_is_left_to_e001():
    from django.test import override_settings

    with override_settings(IDEMPOTENCY=["x"]):
        assert run(*outbox_rows()) == []
        assert check_consumers() == []


@pytest.mark.django_db(databases="__all__")
def test_call_command_check_fails_on_a_bad_outbox_setting():
    with settings_with(OUTBOX_BATCH_SIZE=0), pytest.raises(SystemCheckError, match="E022"):
        call_command("check")


def test_idempotent_task_without_acks_late_warns():
    with current_celery_app() as app:

        @app.task(shared=False, acks_late=False, name="checks.early_ack")
        @idempotent_consumer
        def early_ack():
            pass

        @app.task(shared=False, acks_late=True, reject_on_worker_lost=True, name="checks.late_ack")
        @idempotent_consumer
        def late_ack():
            pass

        warnings = check_consumers()
    assert ids(warnings) == [checks.W021]
    assert "checks.early_ack" in warnings[0].msg


def test_idempotent_task_without_reject_on_worker_lost_warns():
    with current_celery_app() as app:

        @app.task(shared=False, acks_late=True, name="checks.lost_with_its_worker")
        @idempotent_consumer
        def lost_with_its_worker():
            pass

        warnings = check_consumers()
        assert ids(warnings) == [checks.W023]
        assert "checks.lost_with_its_worker" in warnings[0].msg
        app.conf.task_reject_on_worker_lost = True
        # The setting reaches tasks created after it; a new task reads it.

        @app.task(shared=False, acks_late=True, name="checks.rejected_on_loss")
        @idempotent_consumer
        def rejected_on_loss():
            pass

        names = [warning.msg for warning in check_consumers()]
    assert not any("checks.rejected_on_loss" in name for name in names)


def test_inbox_retention_shorter_than_the_visibility_timeout_warns():
    with current_celery_app(broker_url="redis://localhost:6379/0"):
        with settings_with(INBOX_RETENTION_SECONDS=600):
            warnings = check_consumers()
        assert ids(warnings) == [checks.W020]
        assert "visibility_timeout" in warnings[0].msg
        assert check_consumers() == []  # the default 14 days is longer


def test_inbox_retention_shorter_than_a_task_retry_span_warns():
    with current_celery_app(broker_url="amqp://") as app:

        @app.task(
            shared=False,
            acks_late=True,
            reject_on_worker_lost=True,
            max_retries=10,
            default_retry_delay=3600,
            name="checks.slow",
        )
        @idempotent_consumer
        def slow_retries():
            pass

        with settings_with(INBOX_RETENTION_SECONDS=5 * 3600):  # retries span 10 hours
            warnings = check_consumers()
    assert ids(warnings) == [checks.W020]
    assert "checks.slow" in warnings[0].msg


def test_inbox_retention_shorter_than_the_outbox_retry_span_warns():
    with current_celery_app(broker_url="amqp://"):
        slow_outbox = {
            "OUTBOX_BACKOFF_MAX_SECONDS": 86400,
            "OUTBOX_MAX_ATTEMPTS": 20,
            "INBOX_RETENTION_SECONDS": 86400,
        }
        with settings_with(**slow_outbox):
            warnings = check_consumers()
    assert ids(warnings) == [checks.W020] and "outbox" in warnings[0].msg


def test_no_skip_locked_warns(monkeypatch):
    assert run(checks.W022, databases=["default"]) == []
    monkeypatch.setattr(connection.features, "has_select_for_update", True)
    monkeypatch.setattr(connection.features, "has_select_for_update_skip_locked", False)
    assert ids(run(checks.W022, databases=["default"])) == [checks.W022]
    assert run(checks.W022, databases=[]) == []
    assert run(checks.W022) == []  # plain `manage.py check` does not ask the database
