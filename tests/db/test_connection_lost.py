"""The database going away: a clear 503 (problem+json), never a 500, and nothing lost."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
from django.db import connection
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.support.proxy import TCPProxy
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

SERVER_DATABASE = connection.vendor in ("postgresql", "mysql")


@contextlib.contextmanager
def database_outage():
    """Yields (cut, restore): the database becomes unreachable for new and open connections."""
    settings_dict = connection.settings_dict
    original = dict(settings_dict)
    proxy = None
    if SERVER_DATABASE:
        default_port = 5432 if connection.vendor == "postgresql" else 3306
        proxy = TCPProxy(
            settings_dict["HOST"] or "127.0.0.1", int(settings_dict["PORT"] or default_port)
        )
        settings_dict.update(HOST="127.0.0.1", PORT=str(proxy.port))

        def cut():
            proxy.cut()

        def restore():
            proxy.restore()
    else:

        def cut():
            connection.close()
            settings_dict["NAME"] = "/nonexistent/directory/db.sqlite3"

        def restore():
            settings_dict["NAME"] = original["NAME"]

    connection.close()
    try:
        yield cut, restore
    finally:
        connection.close()
        settings_dict.clear()
        settings_dict.update(original)
        if proxy is not None:
            proxy.close()


def post(client, key, body):
    return client.post("/api/widget/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def assert_unavailable(response):
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["error"] == "idempotency_store_unavailable"
    assert int(response["Retry-After"]) >= 1


def test_database_down_at_claim_time_is_a_503_and_retry_works(key):
    client = APIClient()
    with database_outage() as (cut, restore):
        cut()
        assert_unavailable(post(client, key, {"name": "w"}))
        restore()
        connection.close()  # what Django does after a request whose connection broke
        response = post(client, key, {"name": "w"})
    assert response.status_code == 201
    assert Widget.objects.count() == 1


@pytest.mark.skipif(not SERVER_DATABASE, reason="needs a network database to cut")
def test_database_lost_mid_request_is_a_503_and_the_key_recovers(key, gate, idempotency_settings):
    idempotency_settings(LEASE_SECONDS=2)
    with database_outage() as (cut, restore):
        started, release = gate("cut")
        results = {}

        def first():
            results["first"] = post(APIClient(), key, {"name": "cut"})
            connection.close()

        thread = threading.Thread(target=first)
        thread.start()
        assert started.wait(20)
        cut()  # the view's connection dies inside its transaction
        release.set()
        thread.join(30)
        assert_unavailable(results["first"])
        restore()
        connection.close()
        time.sleep(2.5)  # the release could not reach the database: wait out the lease
        gates_off = APIClient()
        response = post(gates_off, key, {"name": "cut"})
    assert response.status_code == 201, response.content
    assert json.loads(response.content)["attempt"] == 2
    assert Widget.objects.count() == 1
    assert IdempotencyRecord.objects.get(key=key).status == "COMPLETED"
