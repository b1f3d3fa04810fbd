"""Counts from several gunicorn workers add up through prometheus_client's multiprocess mode."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.db import connection
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def post(url: str, key: str) -> int:
    request = urllib.request.Request(
        url,
        data=json.dumps({"name": key}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status)


def wait_until_serving(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"gunicorn exited:\n{log.read_text()}")
        try:
            urllib.request.urlopen(url, timeout=5)
        except urllib.error.HTTPError:
            return  # a 405 for GET: the app answers
        except OSError:
            time.sleep(0.2)
            continue
        return
    pytest.fail(f"gunicorn did not start:\n{log.read_text()}")


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_gunicorn_workers_share_one_set_of_counts(tmp_path):
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    log = tmp_path / "gunicorn.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}/api/widget/"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "TEST_DATABASE_NAME": str(connection.settings_dict["NAME"]),
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "--workers=2",
        "--threads=2",
        f"--bind=127.0.0.1:{port}",
        "--config=python:tests.gunicorn_metrics",
        "django.core.wsgi:get_wsgi_application()",
    ]
    with log.open("wb") as output:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)
    try:
        wait_until_serving(url, server, log)
        keys = [f"mp-{uuid.uuid4()}" for _ in range(8)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            assert set(pool.map(lambda key: post(url, key), keys)) == {201}
            assert set(pool.map(lambda key: post(url, key), keys)) == {201}  # replays
    finally:
        server.terminate()
        server.wait(60)

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    claims = "django_idempotency_claims_total"
    assert registry.get_sample_value(claims, {"outcome": "claimed"}) == 8
    assert registry.get_sample_value(claims, {"outcome": "replayed"}) == 8
    assert (
        registry.get_sample_value(
            "django_idempotency_claim_duration_seconds_count", {"outcome": "claimed"}
        )
        == 8
    )
    assert list(metrics_dir.glob("counter_*.db")), "workers wrote no sample files"
