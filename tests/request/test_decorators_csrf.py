"""Where ``@csrf_exempt`` goes relative to ``@idempotent``: a POST without a CSRF token (curl's)
must reach the view, once, and its retry must be replayed (docs/howto/function-views.md)."""

from __future__ import annotations

import pytest
from django.test import Client

from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Widget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.support.csrf_urls")]

WITH_CSRF = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]


@pytest.fixture
def curl(settings) -> Client:
    """Like curl: no cookie, no CSRF token, and a server that checks CSRF."""
    settings.MIDDLEWARE = WITH_CSRF
    return Client(enforce_csrf_checks=True)


def post(client: Client, path: str, key: str, name: str = "w"):
    return client.post(
        path, {"name": name}, content_type="application/json", headers={"Idempotency-Key": key}
    )


@pytest.mark.parametrize("path", ["/exempt-above/", "/exempt-below/"])
def test_csrf_exempt_on_either_side_of_idempotent_lets_curl_in(curl, key, path):
    first = post(curl, path, key)
    retry = post(curl, path, key)
    assert first.status_code == 201, first.content
    assert first.headers["Idempotent-Replay"] == "false"
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replay"] == "true"
    assert retry.json() == first.json()
    assert Widget.objects.count() == 1


def test_without_csrf_exempt_curl_gets_403_and_the_key_stays_free(curl, key):
    refused = post(curl, "/not-exempt/", key)
    assert refused.status_code == 403
    assert Widget.objects.count() == 0
    # The middleware refused before the view (and its claim) ran: nothing holds the key.
    assert not IdempotencyRecord.objects.filter(key=key).exists()
