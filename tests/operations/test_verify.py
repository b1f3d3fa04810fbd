"""``manage.py idempotency_verify`` on every backend: it passes on a sound project, fails on a
broken one, reports misconfiguration instead of a traceback, and leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections

from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.operations import verify as verifying
from django_idempotency.operations.verify import PLAN, Result, VerifyOptions, verify
from django_idempotency.operations.verify.outbox import killed_relay
from django_idempotency.operations.verify.results import guarded
from django_idempotency.operations.verify.scratch import Scratch, clean_up
from django_idempotency.request import claims, redis_copy
from tests.support import settings_verify_secrets as secret_settings
from tests.support.servers import ROOT, gunicorn
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "records"])

ROWS = [name for name, _ in PLAN]


@pytest.fixture(autouse=True)
def children_use_the_test_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes the checks kill load tests.settings: point them at the test database."""
    monkeypatch.setenv("TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))


def results(output: str) -> dict[str, str]:
    """Each table row's result, by check name."""
    found = {}
    for line in output.splitlines():
        for name in ROWS:
            if line.startswith(name):
                found[name] = line[len(name) :].split()[0]
    return found


def unwrapped(output: str) -> str:
    """The table's text with its wrapping undone (one space between words)."""
    return " ".join(output.split())


def run_command(*args: str) -> tuple[str, CommandError | None]:
    out = StringIO()
    try:
        call_command("idempotency_verify", *args, stdout=out)
    except CommandError as error:
        return out.getvalue(), error
    return out.getvalue(), None


def nothing_left_behind() -> None:
    for alias in ("default", "records"):
        assert not IdempotencyRecord.objects.using(alias).exists()
        assert not ProcessedMessage.objects.using(alias).exists()
        assert not OutboxEvent.objects.using(alias).exists()


def test_every_check_passes_on_this_backend() -> None:
    output, error = run_command()
    assert error is None, output
    rows = results(output)
    assert set(rows) == set(ROWS), output
    skipped = {name for name, result in rows.items() if result == "SKIP"}
    assert skipped == {"Redis copy configuration", "Redis copy survives an outage"}
    assert "effects committed: 1" in unwrapped(output) and "lost: 0" in unwrapped(output)
    assert "Every check passed." in output
    nothing_left_behind()


@pytest.mark.parametrize("redis", ["standalone", "cluster"])
def test_the_redis_copy_survives_an_outage(
    settings: Any, request: pytest.FixtureRequest, redis: str
) -> None:
    options: dict[str, Any] = {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5}
    if redis == "cluster":
        location = request.getfixturevalue("redis_cluster").url
        options["CONNECTION_FACTORY"] = (
            "django_idempotency.request.redis_cluster.ClusterConnectionFactory"
        )
    else:
        location = request.getfixturevalue("redis_url")
    settings.CACHES = {
        **settings.CACHES,
        "idempotency": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": location,
            "OPTIONS": options,
        },
    }
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "CACHE_ALIAS": "idempotency"}
    report = verify()
    by_name = {result.name: result for result in report.results}
    assert report.ok, report.table()
    outage = by_name["Redis copy survives an outage"]
    assert outage.passed is True
    assert "replay 201 with 0 database queries" in outage.evidence
    assert "copied to Redis: yes" in outage.evidence
    from django_redis import get_redis_connection

    # Every copy of the run's scope, whatever its key: the names carry the scope's digest.
    scope_digest = redis_copy.hash_tag(f"{verifying.PREFIX}:{report.run}", "").partition(":")[0]
    client = get_redis_connection("idempotency")
    assert not list(client.scan_iter(f"*idem:{{{scope_digest}:*"))
    nothing_left_behind()


def test_routers_and_atomic_requests_of_the_project_are_honoured() -> None:
    """The whole command in a process of its own, on settings that route every model of the app
    to the ``records`` database and turn ATOMIC_REQUESTS on."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.support.settings_verify_routed",
        "PYTHONPATH": str(ROOT),
    }
    finished = subprocess.run(
        [sys.executable, "-m", "django", "idempotency_verify"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    text = unwrapped(finished.stdout)
    assert "IdempotencyRecord -> 'records'" in text
    assert "the view ran inside transactions on default, records;" in text
    assert "the claim was committed before the view: yes" in text
    assert "Every check passed." in text
    nothing_left_behind()


def test_against_a_running_deployment() -> None:
    with gunicorn(workers=2) as server:
        url = f"http://127.0.0.1:{server.port}/api/widget/"
        output, error = run_command("--url", url, "--body", '{"name": "verify", "sleep": 0.5}')
    assert error is None, output
    assert results(output)["concurrent duplicates run once"] == "PASS"
    assert "answered 409" in output or "replayed" in output
    assert results(output)["replay is byte-identical, no Set-Cookie"] == "PASS"
    assert results(output)["fingerprint mismatch is 422"] == "PASS"
    assert Widget.objects.filter(name="verify").count() == 2  # the concurrent key, the 422 key
    nothing_left_behind()


def test_a_broken_claim_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that forgets keys lets duplicates run: the checks say so, and exit non-zero."""
    claim = claims.claim

    def forgetful(identity: Any, owner_token: Any, **terms: Any) -> Any:
        IdempotencyRecord.objects.filter(scope=identity.scope, key=identity.key).delete()
        return claim(identity, owner_token, **terms)

    monkeypatch.setattr(claims, "claim", forgetful)
    # No read answers a likely retry (PostgreSQL's claims.answer) from the key it forgets.
    monkeypatch.setattr(claims, "answer", lambda identity, using=None: None)
    output, error = run_command()
    assert error is not None and error.returncode == 1
    # Concurrent duplicates may still look fine (a later claim fences the earlier ones out);
    # a reused key with another body runs instead of answering 422, every time.
    assert results(output)["fingerprint mismatch is 422"] == "FAIL"
    assert "checks failed" in str(error)
    nothing_left_behind()


def test_missing_migrations_are_reported_not_raised(settings: Any) -> None:
    settings.DATABASE_ROUTERS = ["tests.support.routers.RecordsElsewhere"]
    call_command("migrate", "django_idempotency", "zero", database="records", verbosity=0)
    try:
        output, error = run_command()
    finally:
        call_command("migrate", "django_idempotency", database="records", verbosity=0)
    assert error is not None
    text = unwrapped(output)
    from django.db.migrations.loader import MigrationLoader

    shipped = [
        name for app, name in MigrationLoader(None).disk_migrations if app == "django_idempotency"
    ]
    assert f"lacks {len(shipped)} migration(s) of django_idempotency (0001_initial," in text
    assert "run `manage.py migrate django_idempotency --database records`" in text
    assert results(output)["concurrent duplicates run once"] == "SKIP"
    assert "Traceback" not in output


def test_an_unknown_cache_alias_is_reported_not_raised(settings: Any) -> None:
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "CACHE_ALIAS": "nowhere"}
    output, error = run_command()
    assert error is not None
    assert "IDEMPOTENCY['CACHE_ALIAS'] = 'nowhere' is not an alias in CACHES" in unwrapped(output)
    rows = results(output)
    assert rows["Redis copy configuration"] == "FAIL"
    assert rows["system checks (django_idempotency)"] == "FAIL"  # E040 too
    assert rows["concurrent duplicates run once"] == "SKIP"


READ_ONLY = {
    "sqlite": ("PRAGMA query_only = ON", "PRAGMA query_only = OFF"),
    "postgresql": (
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
    ),
    "mysql": ("SET SESSION TRANSACTION READ ONLY", "SET SESSION TRANSACTION READ WRITE"),
}


def test_a_read_only_database_is_reported_not_raised() -> None:
    on, off = READ_ONLY[connection.vendor]
    with connection.cursor() as cursor:
        cursor.execute(on)
    try:
        output, error = run_command()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(off)
    assert error is not None
    assert "database 'default' (" in output and "refuses writes" in unwrapped(output)
    assert results(output)["concurrent duplicates run once"] == "SKIP"


def test_a_check_that_raises_fails_with_the_error_not_a_traceback() -> None:
    def broken() -> Result:
        raise RuntimeError("the broker said no\nand more")

    result = guarded("a check", broken)
    assert result == Result("a check", False, "unexpected error: RuntimeError: the broker said no")


def test_dry_run_lists_the_checks_and_writes_nothing() -> None:
    output, error = run_command("--dry-run")
    assert error is None
    lines = output.splitlines()
    assert len(lines) == len(ROWS)
    assert all(line.startswith(f"{name}: ") for line, name in zip(lines, ROWS, strict=True))
    nothing_left_behind()


def test_bad_options_are_refused() -> None:
    with pytest.raises(CommandError, match="Name: value"):
        call_command("idempotency_verify", "--header", "no colon")
    with pytest.raises(CommandError, match="lease-seconds"):
        call_command("idempotency_verify", "--lease-seconds", "0")


def test_leftovers_of_an_interrupted_run_are_swept() -> None:
    from datetime import timedelta

    from django.utils import timezone

    old = timezone.now() - timedelta(hours=2)
    ProcessedMessage.objects.create(
        consumer=f"{verifying.PREFIX}:deadbeef", message_id="x", processed_at=old
    )
    ProcessedMessage.objects.create(consumer="billing", message_id="x", processed_at=old)
    report = verify(VerifyOptions())
    assert report.ok, report.table()
    assert list(ProcessedMessage.objects.values_list("consumer", flat=True)) == ["billing"]
    connections.close_all()


def test_the_outbox_check_can_go_through_a_configured_route() -> None:
    """``--outbox-topic``: the scratch events take the route configured for that topic (the
    test settings' catch-all, the in-memory publisher here; a real broker in a project)."""
    scratch = Scratch()
    try:
        result = killed_relay(scratch, VerifyOptions(outbox_topic="orders.verified"))
    finally:
        clean_up(scratch)
    assert result.passed is True, result.evidence
    assert "on 'orders.verified'" in result.evidence and "lost: 0" in result.evidence
    nothing_left_behind()


def exec_image(pid: int) -> tuple[bytes, bytes]:
    """The command line and environment the process ``pid`` was started with, as any local
    user reads them. Popen returns while the kernel may still be laying out the new program's
    arguments, which read as empty until it is done."""
    proc = Path(f"/proc/{pid}")
    deadline = time.monotonic() + 10
    while not (cmdline := (proc / "cmdline").read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.001)
    return cmdline, (proc / "environ").read_bytes()


@pytest.mark.parametrize("topic", sorted(secret_settings.ROUTES))
def test_no_secret_of_the_route_reaches_a_child_process(
    topic: str, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The killed relay of ``--outbox-topic`` gets the topic, never the route's OPTIONS: any
    local user reads a process's command line, and process agents and audit logs keep it. The
    child resolves the route from the settings it loads (``tests.support.settings_verify_secrets``,
    the routes the parent has too)."""
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "OUTBOX_PUBLISHERS": secret_settings.ROUTES}
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "tests.support.settings_verify_secrets")
    seen: list[tuple[str, bytes, bytes]] = []

    class Watched(subprocess.Popen[bytes]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append((str(self.pid), *exec_image(self.pid)))

    monkeypatch.setattr(subprocess, "Popen", Watched)
    scratch = Scratch()
    result = None
    try:
        # Nothing listens on the routes' ports: the child never publishes, and is killed when
        # the timeout runs out. What this test reads is the child's exec image, taken as it
        # was spawned, so a second is enough: longer only waits for a line that cannot come.
        with contextlib.suppress(RuntimeError):
            result = killed_relay(
                scratch, VerifyOptions(outbox_topic=topic, lease_seconds=1, timeout=1)
            )
    finally:
        clean_up(scratch)
    assert len(seen) == 1, result
    pid, cmdline, environ = seen[0]
    assert result is None or pid in result.evidence
    assert topic.encode() in cmdline and b"DJANGO_SETTINGS_MODULE" in environ
    for secret in secret_settings.SECRETS:
        assert secret.encode() not in cmdline, "a secret on the command line"
        assert secret.encode() not in environ, "a secret in the environment"


@pytest.mark.slow
def test_the_demo_runs_it_with_a_table_and_nothing_on_stderr(tmp_path: Any) -> None:
    """The demo logs the app at INFO to the console, as a project that wants to see its events
    does: the checks' own conflicts and takeovers must not print bare lines around the table."""
    env = {
        **{name: value for name, value in os.environ.items() if not name.startswith("DJANGO_")},
        "DJANGO_SETTINGS_MODULE": "demo_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'demo.sqlite3'}",
    }
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=300)
    verified = subprocess.run(
        [*manage, "idempotency_verify"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "Every check passed." in verified.stdout
    assert verified.stderr == ""
