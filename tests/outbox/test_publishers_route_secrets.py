"""A publisher route holds a signing secret and a broker password: no mistake in it may print them.

``manage.py check``, the exception ``publish()`` raises (and the 500 and traceback it reaches),
the relay's stored ``last_error`` and its logs name the setting, the route's pattern and the
problem, never an option's value.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import transaction
from django.test import Client

from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.base import Publisher
from django_idempotency.publishers.routing import PublisherSet, Route, build, resolve_route
from tests.support.outbox_support import settings_with

pytestmark = pytest.mark.django_db(databases="__all__")

SECRET = "whsec_d2hzZWMtMGY5ZThkN2M2YjVh"  # base64 of "whsec-0f9e8d7c6b5a"
PASSWORD = "pa55-w0rd-4f3e"
TOKEN = "tok-1a2b3c4d"
SECRETS = (SECRET, PASSWORD, TOKEN)
URL = f"https://hooks:{PASSWORD}@receiver.example/hooks/{TOKEN}?token={TOKEN}"
WEBHOOK = "django_idempotency.publishers.webhook.WebhookPublisher"
AMQP = "django_idempotency.publishers.amqp.AMQPPublisher"
OPTIONS = {"url": URL, "secret": SECRET}
SETTING = "IDEMPOTENCY['OUTBOX_PUBLISHERS']['orders.*']"

#: Malformed routes, each a mistake a person makes beside or around OPTIONS.
MALFORMED = {
    "a key beside OPTIONS": {"BACKEND": WEBHOOK, "OPTIONS": OPTIONS, "TIMEOUT": 5},
    "a secret beside OPTIONS": {"BACKEND": WEBHOOK, "OPTIONS": OPTIONS, "SECRET": SECRET},
    "OPTIONS misspelt": {"BACKEND": WEBHOOK, "OPTONS": OPTIONS},
    "BACKEND misspelt": {"BACKND": WEBHOOK, "OPTIONS": OPTIONS},
    "OPTIONS not a dict": {"BACKEND": WEBHOOK, "OPTIONS": [URL, SECRET]},
    "not a dict at all": [WEBHOOK, OPTIONS],
    "a URL as the spec": (URL, SECRET),
}


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text


def full_traceback(exc: BaseException) -> str:
    """What a log handler or Django's 500 handling prints: the exception and its chain."""
    return "".join(traceback.format_exception(exc))


def check_report() -> str:
    out = StringIO()
    try:
        call_command("check", stdout=out, stderr=out)
    except SystemCheckError as exc:
        return str(exc) + out.getvalue()
    return out.getvalue()


def logged(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter("%(message)s")
    return "\n".join(formatter.format(record) + repr(record.__dict__) for record in caplog.records)


@pytest.mark.parametrize("mistake", sorted(MALFORMED))
def test_a_malformed_route_is_e020_without_its_secrets(mistake: str) -> None:
    with settings_with(OUTBOX_PUBLISHERS={"orders.*": MALFORMED[mistake]}):
        report = check_report()
    assert "django_idempotency.E020" in report
    assert SETTING in report
    assert_no_secret(report)


@pytest.mark.parametrize("mistake", sorted(MALFORMED))
def test_publish_raises_without_the_secrets(mistake: str, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    with (
        settings_with(OUTBOX_PUBLISHERS={"orders.*": MALFORMED[mistake]}),
        pytest.raises(IdempotencyConfigurationError) as raised,
        transaction.atomic(),
    ):
        publish("orders.paid", {"total": "9.99"})
    assert str(raised.value).startswith(SETTING)
    assert_no_secret(str(raised.value))
    assert_no_secret(repr(raised.value))
    assert_no_secret(full_traceback(raised.value))
    assert_no_secret(logged(caplog))


def test_the_500_a_malformed_route_reaches_shows_and_logs_no_secret(caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    client = Client(raise_request_exception=False)
    with settings_with(OUTBOX_PUBLISHERS={"*": MALFORMED["a secret beside OPTIONS"]}):
        response = client.post(
            "/plain/publish/",
            {"name": "leak"},
            content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=f"route-{uuid.uuid4()}",
        )
    assert response.status_code == 500
    assert_no_secret(response.content.decode())
    errors = [record for record in caplog.records if record.exc_info]
    assert errors  # Django logged the traceback of the 500
    formatter = logging.Formatter("%(message)s")
    for record in errors:
        assert_no_secret(formatter.format(record))
    assert_no_secret(logged(caplog))


def test_a_misspelt_option_is_e028_and_a_relay_failure_without_secrets(caplog: Any) -> None:
    route = {"BACKEND": WEBHOOK, "OPTIONS": {"url": URL, "secert": SECRET}}
    caplog.set_level(logging.DEBUG)
    with settings_with(OUTBOX_PUBLISHERS={"orders.*": route}):
        report = check_report()
        with transaction.atomic():
            event = publish("orders.paid", {"total": "9.99"})
        with Relay(allow_in_transaction=True) as relay:
            stats = relay.run_once()
    assert "django_idempotency.E028" in report and "'secert'" in report
    assert_no_secret(report)
    assert stats.failed == 1
    stored = OutboxEvent.objects.get(pk=event.pk).last_error
    assert SETTING in stored and "'secert'" in stored
    assert_no_secret(stored)
    assert_no_secret(logged(caplog))


class QuotesItsOptions(Publisher):
    """A third-party publisher whose constructor puts what it was given in its error."""

    def __init__(self, *, url: str) -> None:
        raise ValueError(f"cannot reach {url}")


class ValidatesItsOptions(Publisher):
    def __init__(self, *, url: str) -> None:
        raise IdempotencyConfigurationError("QuotesItsOptions needs an https URL.")


def test_a_constructor_that_quotes_its_options_is_not_repeated() -> None:
    route = Route("orders.*", f"{__name__}.QuotesItsOptions", {"url": URL})
    with pytest.raises(IdempotencyConfigurationError) as raised:
        build(route)
    assert str(raised.value).startswith(SETTING)
    assert "ValueError" in str(raised.value) and "'url'" in str(raised.value)
    assert_no_secret(full_traceback(raised.value))  # the chain is dropped, not just hidden


def test_a_publishers_own_validation_error_names_the_route() -> None:
    route = Route("orders.*", f"{__name__}.ValidatesItsOptions", {"url": URL})
    with pytest.raises(IdempotencyConfigurationError) as raised:
        build(route)
    assert str(raised.value) == f"{SETTING}: QuotesItsOptions needs an https URL."
    assert_no_secret(full_traceback(raised.value))


@pytest.mark.parametrize(
    "options",
    [
        {"url": "", "secret": SECRET},  # WebhookPublisher's own validation
        {"url": URL, "secret": ""},
    ],
)
def test_shipped_publishers_validation_names_options_not_values(options: dict[str, str]) -> None:
    with (
        settings_with(OUTBOX_PUBLISHERS={"orders.*": {"BACKEND": WEBHOOK, "OPTIONS": options}}),
        pytest.raises(IdempotencyConfigurationError) as raised,
    ):
        PublisherSet().for_topic("orders.paid")
    assert str(raised.value).startswith(SETTING) and "'secret'" in str(raised.value)
    assert_no_secret(full_traceback(raised.value))


def test_amqp_validation_names_options_not_values() -> None:
    options = {"url": f"amqp://guest:{PASSWORD}@broker.example//", "exchange": ""}
    with (
        settings_with(OUTBOX_PUBLISHERS={"orders.*": {"BACKEND": AMQP, "OPTIONS": options}}),
        pytest.raises(IdempotencyConfigurationError, match="'exchange'") as raised,
    ):
        PublisherSet().for_topic("orders.paid")
    assert_no_secret(full_traceback(raised.value))


def test_a_route_repr_leaves_its_options_out() -> None:
    route = resolve_route("orders.paid", {"orders.*": {"BACKEND": WEBHOOK, "OPTIONS": OPTIONS}})
    assert route.options == OPTIONS
    assert_no_secret(repr(route))
