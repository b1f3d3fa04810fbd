import uuid
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from django_idempotency import signals, tasks
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.operations.sweeps import (
    sweep_expired_records,
    sweep_processed_messages,
    sweep_published_events,
)
from django_idempotency.publishers.memory import broker
from tests.outbox_support import publish_committed, settings_with

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
    for task in (tasks.relay_outbox, tasks.sweep_outbox_events):
        assert task.acks_late


def test_beat_schedule_names_registered_tasks():
    from celery import current_app

    registered = set(current_app.tasks)
    for entry in tasks.BEAT_SCHEDULE.values():
        assert entry["task"] in registered
        assert entry["schedule"] > 0


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


def test_relay_command_one_pass_and_exit_codes():
    for n in range(3):
        publish_committed(payload={"n": n})
    assert "3 events due" in run("outbox_relay", "--dry-run")
    assert broker.snapshot() == []
    output = run("outbox_relay", "--batch-size", "2")
    assert "3 claimed, 3 published" in output
    assert len(broker.snapshot()) == 3
    publish_committed()
    broker.fail_when(lambda m: True)
    with pytest.raises(CommandError, match="1 events failed") as error:
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
