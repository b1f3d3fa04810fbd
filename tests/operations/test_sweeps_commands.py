import logging
import uuid
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone
from freezegun import freeze_time

from django_idempotency import signals, tasks
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.operations.sweeps import (
    sweep_expired_records,
    sweep_processed_messages,
    sweep_published_events,
)
from django_idempotency.publishers.memory import broker
from django_idempotency.testing import age
from tests.support.outbox_support import publish_committed, relays_back_off_in_full, settings_with

pytestmark = pytest.mark.django_db(transaction=True)

DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def clean():
    broker.clear()
    yield
    broker.clear()


@pytest.fixture
def batches():
    seen = []

    def record(sender, count, sweep, **kwargs):
        seen.append((sender.__name__, sweep, count))

    signals.rows_swept.connect(record)
    yield seen
    signals.rows_swept.disconnect(record)


def make_record(**overrides):
    now = timezone.now()
    values = {
        "scope": "user:1",
        "key": str(uuid.uuid4()),
        "fingerprint": "f" * 64,
        "status": IdempotencyRecord.Status.COMPLETED,
        "owner_token": uuid.uuid4(),
        "method": "POST",
        "path": "/x",
        "created_at": now,
        "expires_at": now + DAY,
        **overrides,
    }
    return IdempotencyRecord.objects.create(**values)


def make_events(published_ago: timedelta, count: int, status="PUBLISHED"):
    events = [publish_committed(payload={"n": n}) for n in range(count)]
    OutboxEvent.objects.filter(pk__in=[e.pk for e in events]).update(
        status=status, published_at=timezone.now() - published_ago
    )
    return events


def make_messages(processed_ago: timedelta, count: int):
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(
            consumer="c", message_id=str(uuid.uuid4()), processed_at=timezone.now() - processed_ago
        )
        for _ in range(count)
    )


def test_record_sweep_deletes_exactly_the_expired_in_batches(batches):
    past = timezone.now() - timedelta(seconds=1)
    expired = [make_record(expires_at=past) for _ in range(5)]
    kept = [
        make_record(),  # completed, not expired
        # PROCESSING past its TTL but its lease still runs: merely slow, kept
        make_record(status="PROCESSING", expires_at=past, lease_expires_at=timezone.now() + DAY),
    ]
    assert sweep_expired_records(batch_size=2, dry_run=True) == 5
    assert IdempotencyRecord.objects.count() == 7
    assert sweep_expired_records(batch_size=2) == 5
    assert batches == [("IdempotencyRecord", "idempotency_records", n) for n in (2, 2, 1)]
    assert set(IdempotencyRecord.objects.values_list("pk", flat=True)) == {r.pk for r in kept}
    assert all(not IdempotencyRecord.objects.filter(pk=r.pk).exists() for r in expired)


def test_event_sweep_keeps_unpublished_and_recent_events(batches):
    with settings_with(OUTBOX_RETENTION_SECONDS=3600):
        old = make_events(timedelta(hours=2), 4)
        recent = make_events(timedelta(minutes=30), 2)
        dead = make_events(timedelta(hours=2), 1, status="DEAD")
        pending = [publish_committed()]
        assert sweep_published_events(batch_size=3) == 4
    assert [count for *_, count in batches] == [3, 1]
    remaining = set(OutboxEvent.objects.values_list("pk", flat=True))
    assert remaining == {e.pk for e in recent + dead + pending}
    assert not remaining & {e.pk for e in old}


def test_message_sweep_uses_inbox_retention(batches):
    with settings_with(INBOX_RETENTION_SECONDS=86400):
        make_messages(timedelta(days=2), 3)
        make_messages(timedelta(hours=1), 2)
        assert sweep_processed_messages(batch_size=10) == 3
    assert ProcessedMessage.objects.count() == 2
    assert batches == [("ProcessedMessage", "processed_messages", 3)]


def test_a_sweep_logs_its_progress_and_an_empty_pass(caplog):
    make_messages(timedelta(days=30), 25)
    with caplog.at_level(logging.DEBUG, logger="django_idempotency.operations.sweeps"):
        assert sweep_processed_messages(batch_size=2) == 25
        assert sweep_processed_messages(batch_size=2) == 0
    lines = [(record.levelno, record.getMessage()) for record in caplog.records]
    progress = [line for line in lines if line[1].startswith("sweeping")]
    # Thirteen batches: the first twelve say how far the sweep got, the 1st and the 11th at
    # INFO; the last (one row) is told by the summary.
    assert len(progress) == 12
    assert [message for level, message in progress if level == logging.INFO] == [
        "sweeping processed_messages: batch 1 deleted 2, 2 so far",
        "sweeping processed_messages: batch 11 deleted 2, 22 so far",
    ]
    assert lines[-2:] == [
        (logging.INFO, "swept 25 processed_messages"),
        (logging.DEBUG, "swept nothing: no processed_messages due"),
    ]
    summary = caplog.records[-2]
    assert (summary.sweep, summary.sweep_count, summary.sweep_batches) == (
        "processed_messages",
        25,
        13,
    )


def test_a_sweep_stopped_half_way_has_counted_the_rows_it_deleted():
    """Rows are counted batch by batch as they are deleted: a sweep that dies half-way (here
    a receiver raising after the second batch) leaves the count of what it did."""
    from tests.support.metrics_support import SampleDelta

    make_messages(timedelta(days=30), 10)
    swept = SampleDelta(
        {"rows": ("django_idempotency_swept_rows_total", {"sweep": "processed_messages"})}
    )
    seen = []

    def die_after_two_batches(sender, count, **kwargs):
        seen.append(count)
        if len(seen) == 2:
            raise SystemExit("killed")

    signals.rows_swept.connect(die_after_two_batches)
    try:
        with pytest.raises(SystemExit):
            sweep_processed_messages(batch_size=3)
    finally:
        signals.rows_swept.disconnect(die_after_two_batches)
    assert swept.delta() == {"rows": 6.0}
    assert ProcessedMessage.objects.count() == 4
    assert sweep_processed_messages(batch_size=3) == 4  # the next run finishes the job
    assert swept.delta() == {"rows": 10.0}


def test_sweeps_judge_age_by_the_database_clock():
    """A worker whose clock runs a month ahead deletes nothing that is not old by the
    database's clock, which claims go by."""
    with settings_with(INBOX_RETENTION_SECONDS=86400):
        make_messages(timedelta(hours=1), 2)
        record = make_record(
            status="PROCESSING",
            expires_at=timezone.now() + timedelta(hours=1),
            lease_expires_at=timezone.now() + timedelta(minutes=5),
        )
        with freeze_time(timezone.now() + timedelta(days=30)):
            assert sweep_processed_messages() == 0
            assert sweep_expired_records() == 0
    assert ProcessedMessage.objects.count() == 2
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()


def test_a_full_last_batch_ends_on_an_empty_select():
    make_messages(timedelta(days=30), 4)
    assert sweep_processed_messages(batch_size=2) == 4
    assert sweep_processed_messages(batch_size=2) == 0


def test_tasks_call_the_same_functions():
    make_messages(timedelta(days=30), 2)
    make_record(expires_at=timezone.now() - DAY)
    make_events(timedelta(days=30), 1)
    publish_committed()
    assert tasks.sweep_processed_messages.apply().get() == 2
    assert tasks.sweep_idempotency_records.apply().get() == 1
    assert tasks.sweep_outbox_events.apply().get() == 1
    result = tasks.relay_outbox.apply().get()
    assert result["published"] == 1 and result["claimed"] == 1


@pytest.mark.parametrize(
    "task",
    [
        tasks.relay_outbox,
        tasks.sweep_idempotency_records,
        tasks.sweep_outbox_events,
        tasks.sweep_processed_messages,
    ],
    ids=lambda task: task.name.rsplit(".", 1)[-1],
)
def test_every_task_is_delivered_again_when_its_worker_dies(task):
    # acks_late: a dead worker's message goes back to the queue; reject_on_worker_lost: also
    # when only its prefork pool process died (tests/operations/test_tasks_celery_beat.py kills
    # both).
    assert task.acks_late and task.reject_on_worker_lost


def test_beat_schedule_names_registered_tasks():
    from celery import current_app

    registered = set(current_app.tasks)
    for entry in tasks.BEAT_SCHEDULE.values():
        assert entry["task"] in registered
        assert entry["schedule"] > 0


def test_every_beat_entry_expires_before_its_next_run():
    for name, entry in tasks.BEAT_SCHEDULE.items():
        assert 0 < entry["options"]["expires"] < entry["schedule"], name


def test_kick_relay_queues_relay_tasks_off_thread_and_coalesces_bursts(monkeypatch):
    import threading

    entered, release = threading.Event(), threading.Event()
    sent = []

    def slow_apply_async(**options):
        sent.append((threading.current_thread().name, options))
        entered.set()
        assert release.wait(30)

    monkeypatch.setattr(tasks.relay_outbox, "apply_async", slow_apply_async)
    tasks.kick_relay("default")
    assert entered.wait(30)  # the first kick is being queued (slowly: a broker timing out)
    for _ in range(20):
        tasks.kick_relay("default")  # the commits are not held up meanwhile
    release.set()
    assert wait_until_idle(tasks._kicker)
    assert len(sent) == 2  # the burst collapsed into one more relay task
    assert sent[0] == ("django-idempotency-relay-kick", {"retry": False, "expires": 60.0})


def test_a_failing_kick_is_logged_and_the_kicker_keeps_going(monkeypatch, caplog):
    calls = []

    def broken(**options):
        calls.append(options)
        raise ConnectionError("broker down")

    monkeypatch.setattr(tasks.relay_outbox, "apply_async", broken)
    with caplog.at_level("WARNING", logger="django_idempotency.tasks"):
        tasks.kick_relay("default")
        assert wait_until_idle(tasks._kicker, calls=calls, count=1)
        tasks.kick_relay("default")
        assert wait_until_idle(tasks._kicker, calls=calls, count=2)
    assert "outbox relay kick failed" in caplog.text


def wait_until_idle(kicker, *, calls=None, count=0):
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if kicker.idle.is_set() and (calls is None or len(calls) >= count):
            return True
        time.sleep(0.01)
    return False


# --- commands -----------------------------------------------------------------------------------


def run(command, *args):
    out = StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue()


def test_sweep_command_reports_per_sweep_and_honours_dry_run():
    make_messages(timedelta(days=30), 3)
    output = run("idempotency_sweep", "--dry-run", "--only", "messages")
    assert "messages: would delete 3" in output and "records" not in output
    assert ProcessedMessage.objects.count() == 3
    output = run("idempotency_sweep", "--batch-size", "2", "-v", "2")
    assert "Sweeping records..." in output
    assert "messages: deleted 3" in output and "Total: deleted 3" in output
    assert run("idempotency_sweep", "-v", "0") == ""
    with pytest.raises(CommandError, match="positive") as error:
        run("idempotency_sweep", "--batch-size", "0")
    assert error.value.returncode == 2


def test_sweep_command_sweeps_as_if_it_were_later():
    with settings_with(INBOX_RETENTION_SECONDS=14 * 86400):
        make_messages(timedelta(days=1), 3)
        assert "messages: would delete 0" in run("idempotency_sweep", "--dry-run")
        output = run("idempotency_sweep", "--only", "messages", "--now", "+14d", "--dry-run")
        assert "messages: would delete 3" in output
        assert "would delete 0" in run("idempotency_sweep", "--now", "+12.5d", "--dry-run")
        assert "Total: deleted 0" in run("idempotency_sweep", "--now", "2000-01-01")
        output = run("idempotency_sweep", "--now", "2100-01-01T00:00:00+00:00", "-v", "2")
        assert "Sweeping as of 2100-01-01T00:00:00+00:00" in output
        assert "messages: deleted 3" in output
    assert ProcessedMessage.objects.count() == 0


@pytest.mark.parametrize("value", ["tomorrow", "+3w", "-2d", "2030-13-01"])
def test_sweep_command_rejects_a_time_it_cannot_read(value):
    with pytest.raises(CommandError, match="neither an ISO 8601 date or time"):
        run("idempotency_sweep", f"--now={value}")


def test_sweep_command_reads_naive_times_in_the_time_zone(settings):
    from django_idempotency.management.commands.idempotency_sweep import moment

    settings.TIME_ZONE = "Europe/Paris"
    assert moment("2030-01-01 01:00") == moment("2030-01-01T00:00:00Z")
    assert moment("2030-01-01") == moment("2029-12-31T23:00:00Z")


def test_age_makes_rows_old_enough_for_the_sweeps():
    with settings_with(INBOX_RETENTION_SECONDS=14 * 86400):
        make_messages(timedelta(0), 2)
        assert age(ProcessedMessage.objects.all(), by=timedelta(days=15)) == 2
        record = make_record(status="COMPLETED")
        expires_at = IdempotencyRecord.objects.get(pk=record.pk).expires_at
        assert age(record, by=timedelta(days=2)) == 1
        aged = IdempotencyRecord.objects.get(pk=record.pk)
        assert aged.expires_at == expires_at - timedelta(days=2)
        assert aged.created_at == record.created_at - timedelta(days=2)
        assert sweep_processed_messages() == 2
        assert sweep_expired_records() == 1


def test_age_needs_a_date_time_column():
    from tests.testapp.models import Widget

    with pytest.raises(TypeError, match="Widget has no date-time column"):
        age(Widget.objects.all(), by=timedelta(days=1))


def test_periodic_tasks_command_says_it_needs_django_celery_beat():
    with pytest.raises(CommandError, match="django-celery-beat is not in INSTALLED_APPS") as error:
        run("idempotency_periodic_tasks")
    assert error.value.returncode == 2
    assert "BEAT_SCHEDULE into CELERY_BEAT_SCHEDULE" in str(error.value)


def test_relay_command_one_pass_and_exit_codes(monkeypatch):
    relays_back_off_in_full(monkeypatch)
    for n in range(3):
        publish_committed(payload={"n": n})
    assert "3 events due" in run("outbox_relay", "--dry-run")
    assert broker.snapshot() == []
    output = run("outbox_relay", "--batch-size", "2")
    assert "3 claimed, 3 published" in output
    assert len(broker.snapshot()) == 3
    publish_committed()
    broker.fail_when(lambda m: True)
    # A backoff far longer than a pass, taken whole: the event is not due again in it.
    with (
        settings_with(OUTBOX_BACKOFF_BASE_SECONDS=60),
        pytest.raises(CommandError, match="1 events failed") as error,
    ):
        run("outbox_relay")
    assert error.value.returncode == 3
    with pytest.raises(CommandError, match="--sleep must be positive"):
        run("outbox_relay", "--loop", "--sleep", "-1")


def test_relay_command_loop_stops_on_sigterm():
    import os
    import signal
    import threading
    import time

    publish_committed()

    def stop_once_published():
        deadline = time.monotonic() + 60
        while not broker.snapshot() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Thread(target=stop_once_published, daemon=True)
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    timer.start()
    try:
        output = run("outbox_relay", "--loop", "--sleep", "0.1")
    finally:
        timer.join(60)
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    assert "Relaying outbox events" in output and "Relay stopped." in output
    assert "1 claimed, 1 published" in output
    assert len(broker.snapshot()) == 1
