"""Counts from several gunicorn workers add up through prometheus_client's multiprocess mode,
and the outbox gauges, read from the database when scraped, are reported once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.db import connection
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.support.factories import OutboxEventFactory
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]


def post(url: str, key: str) -> int:
    request = urllib.request.Request(
        url,
        data=json.dumps({"name": key}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


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


@contextmanager
def gunicorn(tmp_path: Path, metrics_dir: Path) -> Iterator[str]:
    """Two gunicorn workers in multiprocess mode, as docs/metrics.md sets them up; yields the
    base URL."""
    log = tmp_path / "gunicorn.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
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
        "--config=python:tests.support.gunicorn_metrics",
        "django.core.wsgi:get_wsgi_application()",
    ]
    with log.open("wb") as output:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)
    try:
        wait_until_serving(f"{base}/api/widget/", server, log)
        yield base
    finally:
        server.terminate()
        server.wait(60)


@pytest.fixture
def metrics_dir(tmp_path: Path) -> Path:
    path = tmp_path / "prometheus"
    path.mkdir()
    return path


def test_gunicorn_workers_share_one_set_of_counts(tmp_path, metrics_dir):
    with gunicorn(tmp_path, metrics_dir) as base:
        url = f"{base}/api/widget/"
        keys = [f"mp-{uuid.uuid4()}" for _ in range(8)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            assert set(pool.map(lambda key: post(url, key), keys)) == {201}
            assert set(pool.map(lambda key: post(url, key), keys)) == {201}  # replays

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


def samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]:
    """Every sample of a scrape, by name and labels; a list, so a repeated series shows."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            found.setdefault(key, []).append(sample.value)
    return found


def test_relays_in_several_workers_add_up_and_the_outbox_gauges_come_once(tmp_path, metrics_dir):
    OutboxEventFactory.create_batch(10)
    OutboxEventFactory.create_batch(2, dead=True)
    pending = ("django_idempotency_outbox_pending_events", ())
    dead = ("django_idempotency_outbox_dead_events", ())
    published = (
        "django_idempotency_outbox_events_published_total",
        (("publisher", "MemoryPublisher"),),
    )
    latency = ("django_idempotency_outbox_publish_latency_seconds_count", ())
    with gunicorn(tmp_path, metrics_dir) as base:
        before = samples(get(f"{base}/metrics/"))
        with ThreadPoolExecutor(max_workers=4) as pool:
            relays = list(pool.map(lambda _: json.loads(get(f"{base}/plain/relay/")), range(8)))
        after = samples(get(f"{base}/metrics/"))
    # Read at scrape time, once per scrape, whichever worker answers.
    assert (before[pending], before[dead]) == ([10], [2])
    assert (after[pending], after[dead]) == ([0], [2])
    assert published not in before
    # The relays ran in the workers; their counts add up over the processes.
    assert sum(relay["published"] for relay in relays) == 10
    assert after[published] == [10] and after[latency] == [10]
