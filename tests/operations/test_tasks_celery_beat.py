"""The library's tasks under a real worker and a real beat, on RabbitMQ.

Each test uses a queue of its own on the broker in ``AMQP_URL`` and starts its worker and beat
processes from ``tests.support.beat_celery``, an app that sets no task option app-wide: what a
killed worker does to a sweep is what the library's tasks declare. Workers are prefork with one pool
process, so "the pool process" and "the whole worker" are two different kills.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from kombu import Connection, Exchange, Queue
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from django_idempotency.models import ProcessedMessage
from django_idempotency.tasks import BEAT_SCHEDULE
from tests.reliability.outbox_helpers import Child, figures, queue_depth, wait_until
from tests.support.outbox_support import REPO_ROOT, database_env
from tests.support.slow import once_per_run

pytestmark = [*once_per_run, pytest.mark.django_db(transaction=True)]

SWEEP = "django_idempotency.tasks.sweep_processed_messages"
RELAY = "django_idempotency.tasks.relay_outbox"


@pytest.fixture
def queue(amqp_url: str) -> Iterator[str]:
    """A queue of this test's own on the shared broker, deleted afterwards."""
    name = f"di-beat-{uuid.uuid4().hex[:10]}"
    yield name
    with Connection(amqp_url) as connection:
        Queue(name, no_declare=True)(connection.default_channel).delete()


def celery_process(
    command: list[str], amqp_url: str, queue: str, work: Path, name: str, **env: str
) -> Child:
    environment = {
        **database_env(),
        "BEAT_AMQP_URL": amqp_url,
        "BEAT_QUEUE": queue,
        "BEAT_WORK_DIR": str(work),
        **env,
    }
    args = [sys.executable, "-m", "celery", "-A", "tests.support.beat_celery", *command]
    return Child(args, environment, name)


def start_worker(amqp_url: str, queue: str, work: Path, name: str, **env: str) -> Child:
    command = [
        "worker", "--pool=prefork", "--concurrency=1", "-Q", queue, "--loglevel=INFO",
        "--without-heartbeat", "--without-gossip", "--without-mingle",
        # A name of its own: its control queue must not clash with any other worker's.
        f"--hostname={name}-{uuid.uuid4().hex[:8]}@%h",
    ]  # fmt: skip
    worker = celery_process(command, amqp_url, queue, work, name, **env)
    wait_until(lambda: consumers(amqp_url, queue) >= 1, timeout=60, what=f"{name} to consume")
    return worker


def start_beat(amqp_url: str, queue: str, work: Path, name: str, *extra: str, **env: str) -> Child:
    command = [
        "beat", "--loglevel=DEBUG", f"--schedule={work / 'celerybeat-schedule'}",
        f"--pidfile={work / f'{name}.pid'}", *extra,
    ]  # fmt: skip
    beat = celery_process(command, amqp_url, queue, work, name, **env)
    # Logged once the scheduler is built, its schedule set up (DatabaseScheduler: synced with
    # the database).
    wait_until(lambda: "beat: Ticking" in beat.output() or not beat.alive(), timeout=60, what=name)
    assert beat.alive(), beat.tail()
    return beat


def stop(beat: Child) -> int:
    """SIGTERM beat while it sleeps between ticks ("Waking up in …" is its last line), not
    while it writes its schedule, and its exit status. (With the DatabaseScheduler on SQLite, a
    SIGTERM that landed as beat wrote its entries once left it hung past the 30 s grace period
    on a loaded machine.) Beat that does not settle within 10 s is stopped anyway."""

    def sleeping() -> bool:
        lines = beat.output().rstrip().splitlines()
        return not beat.alive() or (bool(lines) and "Waking up in" in lines[-1])

    with contextlib.suppress(AssertionError):  # wait_until timing out
        wait_until(sleeping, timeout=10, what=f"{beat.name} to sleep between ticks")
    return beat.terminate()


def consumers(amqp_url: str, queue: str) -> int:
    with Connection(amqp_url) as connection:
        try:
            declared = connection.default_channel.queue_declare(queue=queue, passive=True)
        except Exception:  # not declared yet: the worker declares it when it starts consuming
            return 0
        return int(declared.consumer_count)


def runs(work: Path) -> list[list[str]]:
    """``[event, task name, task id, detail]`` for every task start, end and expiry noted, in the
    order they happened across every worker process (pids do not sort in time)."""
    noted = [
        line.split() for path in work.glob("runs-*.log") for line in path.read_text().splitlines()
    ]
    return [words[1:] for words in sorted(noted, key=lambda words: int(words[0]))]


def send(amqp_url: str, queue: str, task: str, expires: float | None = None, **kwargs: Any) -> str:
    from tests.support.beat_celery import make_app

    app = make_app(amqp_url, queue)
    try:
        return str(app.send_task(task, kwargs=kwargs, expires=expires).id)
    finally:
        app.close()


def swept_rows_counted(metrics_dir: Path) -> float:
    """``django_idempotency_swept_rows_total`` summed over every process that wrote it."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    value = registry.get_sample_value(
        "django_idempotency_swept_rows_total", {"sweep": "processed_messages"}
    )
    return float(value or 0.0)


def old_markers(count: int) -> None:
    processed_at = timezone.now() - timedelta(days=30)
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="old", message_id=str(n), processed_at=processed_at)
        for n in range(count)
    )


# --- a killed worker ---------------------------------------------------------------------------


@pytest.mark.parametrize("kill", ["pool process", "whole worker"])
def test_a_sweep_killed_half_way_is_delivered_again_and_finishes_once(
    amqp_url: str, queue: str, tmp_path: Path, kill: str
) -> None:
    """SIGKILL in the middle of a sweep, after five of its fifteen batches. ``pool process``:
    only the prefork child dies; the task's ``reject_on_worker_lost`` makes the worker requeue
    the message, and a new child sweeps again. ``whole worker``: the worker and its child die;
    the broker requeues the unacknowledged message for the next worker. Either way the second
    run deletes what the first left, once, and the rows the first deleted were counted in the
    metrics and logged as it went."""
    batch, held_after, expired, fresh = 200, 5, 3000, 40
    old_markers(expired)
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="fresh", message_id=str(n), processed_at=timezone.now())
        for n in range(fresh)
    )
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (tmp_path / "hold-after").write_text(str(held_after))
    (tmp_path / "hold").touch()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    workers = [start_worker(amqp_url, queue, tmp_path, "doomed", **env)]
    try:
        task_id = send(amqp_url, queue, SWEEP, batch_size=batch)
        wait_until(lambda: (tmp_path / "held").exists(), timeout=60, what="the sweep to hold")
        left_when_killed = ProcessedMessage.objects.filter(consumer="old").count()
        killed_log = workers[0].output()
        if kill == "pool process":
            os.kill(int((tmp_path / "held").read_text()), signal.SIGKILL)
            # The worker says which task it lost and what became of its message.
            lost = f"{SWEEP}[{task_id}] lost its worker process"
            wait_until(lambda: lost in workers[0].output(), timeout=60, what="the lost line")
            assert f"{lost} (Worker exited prematurely: signal 9 (SIGKILL)" in workers[0].output()
            assert "the message was requeued, and runs again" in workers[0].output()
        else:
            workers[0].kill()
        (tmp_path / "hold-after").unlink()
        (tmp_path / "hold").unlink()
        if kill == "whole worker":
            workers.append(start_worker(amqp_url, queue, tmp_path, "next", **env))
        wait_until(
            lambda: any(run[0] == "end" for run in runs(tmp_path)),
            timeout=60,
            what="the sweep to finish",
        )
        for worker in workers:
            if worker.alive():  # a warm shutdown: the worker acknowledges what it finished
                assert worker.terminate() == 0, worker.tail()
    except BaseException:
        for worker in workers:
            print(worker.tail())
        raise
    finally:
        for worker in workers:
            worker.close()

    assert left_when_killed == expired - held_after * batch  # its five batches had committed
    starts = [run for run in runs(tmp_path) if run[0] == "start"]
    ends = [run for run in runs(tmp_path) if run[0] == "end"]
    assert [(run[2], run[3]) for run in starts] == [(task_id, "False"), (task_id, "True")]
    assert [(run[2], run[3]) for run in ends] == [(task_id, str(left_when_killed))]
    assert ProcessedMessage.objects.filter(consumer="old").count() == 0
    assert ProcessedMessage.objects.filter(consumer="fresh").count() == fresh
    # Counted batch by batch: the killed run's 1,000 rows too, none twice.
    assert swept_rows_counted(metrics) == expired
    # The killed run said how far it had got before it died.
    assert "sweeping processed_messages: batch 1 deleted 200, 200 so far" in killed_log
    assert queue_depth(amqp_url, queue) == 0
    figures(
        f"sweep killed ({kill})",
        deleted_before_kill=expired - left_when_killed,
        deleted_by_redelivery=left_when_killed,
        deliveries=len(starts),
        rows_counted=swept_rows_counted(metrics),
    )


def test_a_sweep_killed_after_its_expiry_is_dropped_and_says_so(
    amqp_url: str, queue: str, tmp_path: Path
) -> None:
    """A beat entry's message expires before the next run. A sweep whose pool process dies
    after that moment is requeued, and the broker drops it unrun: the worker's line says so,
    and the next scheduled run does the work.

    The expiry is long enough for a loaded machine's worker to take the message well before it
    (a message taken after it is dropped unrun by the worker, and the test says so rather than
    waiting for a hold that never comes); the sweep is held until the expiry has passed by both
    the broker's clock and the worker's, and only then killed."""
    expires = 15.0
    old_markers(600)
    (tmp_path / "hold-after").write_text("1")
    (tmp_path / "hold").touch()
    worker = start_worker(amqp_url, queue, tmp_path, "doomed")
    try:
        task_id = send(amqp_url, queue, SWEEP, expires=expires, batch_size=200)
        # send() returns once the broker has confirmed the message: its TTL started before
        # this, and the expiry Celery wrote into it was computed before this too.
        expired_by = time.monotonic() + expires

        def held_or_dropped() -> bool:
            return (tmp_path / "held").exists() or ["expired", SWEEP, task_id] in [
                run[:3] for run in runs(tmp_path)
            ]

        wait_until(held_or_dropped, timeout=60, what="the sweep to hold")
        assert (tmp_path / "held").exists(), (
            f"the worker took the sweep only after its {expires} s expiry and dropped it unrun: "
            f"{runs(tmp_path)}"
        )
        wait_until(lambda: time.monotonic() > expired_by, timeout=60, what="the expiry")
        os.kill(int((tmp_path / "held").read_text()), signal.SIGKILL)
        lost = f"{SWEEP}[{task_id}] lost its worker process"
        wait_until(lambda: lost in worker.output(), timeout=60, what="the lost line")
        (tmp_path / "hold").unlink()
        line = next(line for line in worker.output().splitlines() if lost in line)
        assert "the message was requeued, but it expired at" in line
        assert "it is dropped unrun, and the next scheduled run does the work" in line
        # A redelivery, which must not come, would come before a relay sent now: the message
        # was requeued (the line is logged after the worker rejected it) to its place ahead
        # of the relay, and the worker takes one message at a time, in order. Nor may the
        # worker have been handed it and dropped it itself: the broker drops it.
        sentinel = send(amqp_url, queue, RELAY)
        wait_until(
            lambda: ["end", RELAY, sentinel] in [run[:3] for run in runs(tmp_path)],
            timeout=60,
            what="the sentinel relay",
        )
        assert [run[0] for run in runs(tmp_path) if run[2] == task_id] == ["start"]
        assert worker.terminate() == 0, worker.tail()
    finally:
        worker.close()
    assert queue_depth(amqp_url, queue) == 0


# --- a worker that is not there ----------------------------------------------------------------


def test_beat_without_a_worker_leaves_no_backlog_to_run(
    amqp_url: str, queue: str, tmp_path: Path
) -> None:
    """Beat sends the shipped schedule, sped up (the relay every second, the sweeps every two,
    each expiring at the same fraction of its interval) while no worker runs. Each message
    expires before its entry's next one is sent, so when a worker finally starts it runs at
    most one message per entry, not the backlog back to back."""
    beat = start_beat(amqp_url, queue, tmp_path, "beat", BEAT_SCHEDULE_MODE="quick")
    try:

        def sent() -> int:
            return beat.output().count("Scheduler: Sending due task")

        # Two periods of every sweep entry, four of the relay's: a backlog without expiry.
        wait_until(lambda: sent() >= 10, timeout=30, what="beat to send ten tasks")
        depth_with_beat_up = queue_depth(amqp_url, queue)
        # Gone as a crashed or redeployed beat would be: what it sent is in the queue, and how
        # it ends is not what this test checks (sending every second, it never sleeps between
        # ticks, and a SIGTERM that lands as it writes its schedule can hang it).
        beat.kill()
        messages_sent = sent()
    finally:
        beat.close()
    depth_at_worker_start = queue_depth(amqp_url, queue)
    worker = start_worker(amqp_url, queue, tmp_path, "late")
    try:
        # A relay sent now, after everything beat sent: once it has run, the rest has been
        # received (one pool process, one message at a time, in order).
        sentinel = send(amqp_url, queue, RELAY)
        wait_until(
            lambda: ["end", RELAY, sentinel] in [run[:3] for run in runs(tmp_path)],
            timeout=60,
            what="the sentinel relay",
        )
        # Whatever reached the queue late (a publish still in flight when beat was killed)
        # goes through the running worker too, and is counted below.
        wait_until(lambda: queue_depth(amqp_url, queue) == 0, timeout=30, what="an empty queue")
        assert worker.terminate() == 0, worker.tail()
    finally:
        worker.close()

    ran = Counter(run[1] for run in runs(tmp_path) if run[0] == "start" and run[2] != sentinel)
    dropped = Counter(run[1] for run in runs(tmp_path) if run[0] == "expired")
    assert set(ran) <= {entry["task"] for entry in BEAT_SCHEDULE.values()}
    assert all(count <= 1 for count in ran.values()), ran
    assert queue_depth(amqp_url, queue) == 0, left_in(amqp_url, queue)
    figures(
        "no worker while beat ran",
        sent_by_beat=messages_sent,
        queued_while_beat_ran=depth_with_beat_up,
        queued_when_worker_started=depth_at_worker_start,
        ran_late=sum(ran.values()),
        dropped_by_worker=sum(dropped.values()),
    )


def left_in(amqp_url: str, queue: str) -> list[Any]:
    """The task names and ids of the messages left in ``queue`` (taken out): what a failed
    check says."""
    left = []
    with Connection(amqp_url) as connection:
        simple = connection.SimpleQueue(queue, no_ack=True)
        try:
            while True:
                try:
                    message = simple.get(timeout=1)
                except simple.Empty:
                    return left
                left.append((message.headers.get("task"), message.headers.get("id")))
        finally:
            simple.close()


# --- django-celery-beat ------------------------------------------------------------------------

DATABASE_SCHEDULER = "--scheduler=django_celery_beat.schedulers:DatabaseScheduler"
RELAY_ENTRY = "django-idempotency-relay-outbox"
#: What an operator does in the admin's change form for the relay's periodic task: another
#: interval and expiry, saved (ModelAdmin.save_model saves the instance, as here).
CHANGE_IN_THE_ADMIN = f"""
from django_celery_beat.models import IntervalSchedule, PeriodicTask
task = PeriodicTask.objects.get(name={RELAY_ENTRY!r})
task.interval, _ = IntervalSchedule.objects.get_or_create(every=2, period="seconds")
task.expire_seconds = 1
task.save()
"""
READ_THE_ENTRY = f"""
from django_celery_beat.models import PeriodicTask
task = PeriodicTask.objects.get(name={RELAY_ENTRY!r})
print(task.interval.every, task.interval.period, task.expire_seconds)
"""


def beat_environment(database: Path) -> dict[str, str]:
    """The environment of a project with django-celery-beat on the SQLite file ``database``."""
    return {
        "DJANGO_SETTINGS_MODULE": "tests.support.settings_beat",
        "TEST_DATABASE": "sqlite",
        "TEST_DATABASE_NAME": str(database),
        "PYTHONPATH": str(REPO_ROOT),
    }


@pytest.fixture(scope="module")
def migrated_beat_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """django-celery-beat's tables, migrated once for the module: each test copies the file
    rather than paying a ``migrate`` process of its own."""
    database = tmp_path_factory.mktemp("beat-template") / "beat.sqlite3"
    manage(beat_environment(database), "migrate", "django_celery_beat", "--verbosity", "0")
    return database


@pytest.fixture
def beat_project(tmp_path: Path, migrated_beat_database: Path) -> dict[str, str]:
    """The environment of a project with django-celery-beat, on a fresh SQLite database."""
    for path in migrated_beat_database.parent.glob(f"{migrated_beat_database.name}*"):
        shutil.copyfile(path, tmp_path / path.name)  # with a -wal file, if one was left
    return beat_environment(tmp_path / migrated_beat_database.name)


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "django", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result


def shell(env: dict[str, str], code: str) -> str:
    return manage(env, "shell", "--verbosity", "0", "-c", code).stdout.strip()


def first_message(amqp_url: str, queue: str) -> Any:
    """The next message in ``queue`` (acknowledged), waiting up to 30 s for one."""
    with Connection(amqp_url) as connection:
        # Declared as Celery declares its default queue, in case beat has not sent yet.
        simple = connection.SimpleQueue(Queue(queue, Exchange(queue), routing_key=queue))
        try:
            message = simple.get(block=True, timeout=30)
            message.ack()
            return message
        finally:
            simple.close()


def test_with_the_database_scheduler_an_interval_changed_in_the_admin_survives_a_restart(
    amqp_url: str, queue: str, tmp_path: Path, beat_project: dict[str, str]
) -> None:
    """The periodic tasks are installed once by the command, not listed in
    CELERY_BEAT_SCHEDULE: the DatabaseScheduler then has nothing to rewrite them from when it
    starts, and runs them as the admin left them."""
    created = manage(beat_project, "idempotency_periodic_tasks").stdout
    assert created.count(": created (every") == len(BEAT_SCHEDULE), created
    beat = start_beat(amqp_url, queue, tmp_path, "beat-1", DATABASE_SCHEDULER, **beat_project)
    assert stop(beat) == 0, beat.tail()
    beat.close()
    shell(beat_project, CHANGE_IN_THE_ADMIN)

    beat = start_beat(amqp_url, queue, tmp_path, "beat-2", DATABASE_SCHEDULER, **beat_project)
    try:
        message = first_message(amqp_url, queue)
        assert stop(beat) == 0, beat.tail()
    finally:
        beat.close()
    kept = manage(beat_project, "idempotency_periodic_tasks").stdout

    assert message.headers["task"] == RELAY
    assert message.properties["expiration"] == "1000"  # the expiry set in the admin
    assert kept.count(": kept (as it is in the database)") == len(BEAT_SCHEDULE), kept
    assert shell(beat_project, READ_THE_ENTRY) == "2 seconds 1"
    # --reset puts the shipped values back (not with --dry-run).
    would = manage(beat_project, "idempotency_periodic_tasks", "--reset", "--dry-run").stdout
    assert f"{RELAY_ENTRY}: would be reset (every 10 s, expires after 9 s)" in would
    assert shell(beat_project, READ_THE_ENTRY) == "2 seconds 1"
    reset = manage(beat_project, "idempotency_periodic_tasks", "--reset").stdout
    assert reset.count(": reset (every") == len(BEAT_SCHEDULE), reset
    assert shell(beat_project, READ_THE_ENTRY) == "10 seconds 9"


def test_with_the_database_scheduler_the_setting_overwrites_the_admin_at_every_start(
    amqp_url: str, queue: str, tmp_path: Path, beat_project: dict[str, str]
) -> None:
    """Why the command exists, and why docs/tasks.md says not to merge BEAT_SCHEDULE into
    CELERY_BEAT_SCHEDULE with django-celery-beat: its scheduler rewrites every periodic task
    named in the setting when it starts (and drops the entries' ``expires``). The command
    says so when it finds them there."""
    shipped = {**beat_project, "BEAT_SCHEDULE_MODE": "shipped"}
    beat = start_beat(amqp_url, queue, tmp_path, "beat-1", DATABASE_SCHEDULER, **shipped)
    assert stop(beat) == 0, beat.tail()
    beat.close()
    shell(shipped, CHANGE_IN_THE_ADMIN)
    assert shell(shipped, READ_THE_ENTRY) == "2 seconds 1"

    beat = start_beat(amqp_url, queue, tmp_path, "beat-2", DATABASE_SCHEDULER, **shipped)
    assert stop(beat) == 0, beat.tail()
    beat.close()

    assert shell(shipped, READ_THE_ENTRY) == "10 seconds None"
    warned = manage(shipped, "idempotency_periodic_tasks", "--dry-run").stderr
    assert "CELERY_BEAT_SCHEDULE also lists" in warned and RELAY_ENTRY in warned


INTERVALS = """
from django_celery_beat.models import PeriodicTask
tasks = PeriodicTask.objects.filter(name__startswith="django-idempotency-").order_by("name")
print(len({task.interval_id for task in tasks}), sorted({task.interval.every for task in tasks}))
"""
EDIT_ONE_INTERVAL = """
from django_celery_beat.models import PeriodicTask
interval = PeriodicTask.objects.get(name="django-idempotency-sweep-records").interval
interval.every = 300
interval.save()
print(PeriodicTask.objects.get(name="django-idempotency-sweep-outbox").interval.every)
"""
SHARE_ONE_INTERVAL = """
from django_celery_beat.models import PeriodicTask
tasks = PeriodicTask.objects.filter(name__startswith="django-idempotency-")
shared = tasks.exclude(name="django-idempotency-relay-outbox").first().interval
for task in tasks.exclude(name="django-idempotency-relay-outbox"):
    task.interval = shared
    task.save()
"""


def test_each_periodic_task_gets_an_interval_of_its_own(beat_project: dict[str, str]) -> None:
    """Editing the interval row of one entry (the admin's "Intervals") changes that entry only;
    ``--reset`` gives entries that an older install left sharing a row one each."""
    manage(beat_project, "idempotency_periodic_tasks")
    assert shell(beat_project, INTERVALS) == f"{len(BEAT_SCHEDULE)} [10, 3600]"
    assert shell(beat_project, EDIT_ONE_INTERVAL) == "3600"
    shell(beat_project, SHARE_ONE_INTERVAL)
    assert shell(beat_project, INTERVALS) == "2 [10, 300]"
    manage(beat_project, "idempotency_periodic_tasks", "--reset")
    assert shell(beat_project, INTERVALS) == f"{len(BEAT_SCHEDULE)} [10, 3600]"
