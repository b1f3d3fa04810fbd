import uuid

import pytest
from django.db import transaction

from django_idempotency import signals
from django_idempotency.exceptions import IdempotencyError
from django_idempotency.inbox import consume_once
from django_idempotency.models import OutboxEvent, ProcessedMessage
from django_idempotency.outbox import publish
from django_idempotency.testing import deliver_concurrently, deliver_twice
from tests.testapp import tasks
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


def handle(message_id: str, name: str = "w", *, consumer: str = "billing") -> bool:
    with consume_once(consumer, message_id) as consumption:
        if not consumption:
            return False
        Widget.objects.create(name=name)
        return True


def test_a_redelivered_message_is_skipped_and_counted():
    skipped = []
    receiver = lambda sender, **kw: skipped.append(kw)  # noqa: E731
    signals.duplicate_skipped.connect(receiver)
    try:
        assert handle("m-1") is True
        assert handle("m-1") is False
        assert handle("m-1", consumer="shipping") is True  # another consumer is independent
    finally:
        signals.duplicate_skipped.disconnect(receiver)
    assert Widget.objects.count() == 2
    assert skipped == [
        {"signal": signals.duplicate_skipped, "consumer": "billing", "message_id": "m-1"}
    ]
    marker = ProcessedMessage.objects.get(consumer="billing")
    assert marker.message_id == "m-1" and marker.processed_at is not None


def test_a_failing_handler_rolls_its_marker_back_so_the_redelivery_runs():
    with pytest.raises(RuntimeError), consume_once("billing", "m-2"):
        Widget.objects.create(name="half")
        raise RuntimeError("handler failed")
    assert not ProcessedMessage.objects.exists() and not Widget.objects.exists()
    assert handle("m-2") is True
    assert Widget.objects.count() == 1


def test_message_ids_compare_exactly():
    assert handle("abc") is True
    assert handle("ABC") is True
    assert handle("abc ") is True
    assert Widget.objects.count() == 3


def test_a_duplicate_inside_an_outer_transaction_leaves_it_usable():
    handle("m-3")
    with transaction.atomic():
        assert handle("m-3") is False
        Widget.objects.create(name="after")
    assert Widget.objects.filter(name="after").exists()


@pytest.mark.parametrize("bad", ["", "x" * 256, None, 1.5])
def test_bad_ids_are_refused(bad):
    with pytest.raises(ValueError, match="at most 255"), consume_once("billing", bad):
        pass
    with pytest.raises(ValueError, match="consumer"), consume_once(bad, "m"):
        pass


def test_events_published_while_handling_get_ids_derived_from_the_message():
    def run(consumer: str) -> list[uuid.UUID]:
        with consume_once(consumer, "m-4"):
            return [publish("widgets.created", {"n": n}).event_id for n in range(3)]

    with pytest.raises(RuntimeError), transaction.atomic():
        first = run("billing")
        raise RuntimeError("crash after publishing")
    again = run("billing")
    assert again == first and len(set(again)) == 3
    assert list(OutboxEvent.objects.order_by("id").values_list("event_id", flat=True)) == again
    with transaction.atomic():
        assert publish("widgets.created", {}).event_id not in again  # outside: random ids
    ProcessedMessage.objects.all().delete()
    other = run("shipping")
    assert set(other).isdisjoint(again)


def test_task_delivered_twice_runs_once_by_task_id():
    first, second = deliver_twice(tasks.record_effect, "twice")
    assert isinstance(first, int) and second is None
    assert Widget.objects.filter(name="twice").count() == 1
    assert ProcessedMessage.objects.get().consumer == tasks.record_effect.name


def test_bound_task_works_too():
    deliver_twice(tasks.record_effect_bound, "bound")
    assert Widget.objects.filter(name="bound").count() == 1


def test_the_event_id_header_wins_over_the_task_id():
    headers = {"event_id": str(uuid.uuid4())}
    for _ in range(2):
        tasks.record_effect.apply(args=["evt"], task_id=str(uuid.uuid4()), headers=headers)
    assert Widget.objects.filter(name="evt").count() == 1
    assert ProcessedMessage.objects.get().message_id == headers["event_id"]


def test_an_explicit_message_id_argument():
    for _ in range(2):
        tasks.record_with_argument.apply(kwargs={"name": "arg", "message_id": "order-9"})
    assert Widget.objects.filter(name="arg").count() == 1
    assert ProcessedMessage.objects.get().consumer == "by-argument"
    result = tasks.record_with_argument.apply(kwargs={"name": "arg", "message_id": None})
    assert isinstance(result.result, IdempotencyError)


def test_a_failing_task_is_not_marked_and_runs_again():
    for _ in range(2):
        result = tasks.fail_after_writing.apply(args=["boom"], task_id="same-id")
        assert isinstance(result.result, tasks.HandlerFailed)
    assert not Widget.objects.exists() and not ProcessedMessage.objects.exists()


def test_a_re_run_handler_re_emits_the_same_event_ids():
    task_id = str(uuid.uuid4())
    with pytest.raises(RuntimeError), transaction.atomic():
        first = tasks.record_and_publish.apply(args=["p"], task_id=task_id).get()
        raise RuntimeError("the worker's transaction died")
    second = tasks.record_and_publish.apply(args=["p"], task_id=task_id).get()
    assert second == first
    assert tasks.record_and_publish.apply(args=["p"], task_id=task_id).get() is None
    assert OutboxEvent.objects.count() == 2


def test_outside_celery_the_decorator_says_what_to_use():
    with pytest.raises(IdempotencyError, match="consume_once"):
        tasks.record_effect.run("direct")
    with pytest.raises(IdempotencyError, match="without a task id"):
        tasks.record_effect("direct")


@pytest.mark.concurrency
def test_the_same_task_delivered_concurrently_runs_once():
    results = deliver_concurrently(tasks.record_effect, "concurrent", times=4)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sum(isinstance(r, int) for r in results) == 1
    assert Widget.objects.filter(name="concurrent").count() == 1


@pytest.mark.concurrency
def test_concurrent_consume_once_with_a_slow_first_handler():
    import threading

    inside = threading.Event()
    release = threading.Event()
    outcome = {}

    def slow():
        from django.db import connections

        try:
            with consume_once("billing", "m-5") as consumption:
                assert consumption
                Widget.objects.create(name="slow")
                inside.set()
                release.wait(30)
        finally:
            connections.close_all()

    def duplicate():
        from django.db import connections

        try:
            outcome["ran"] = handle("m-5", name="dup")
        finally:
            connections.close_all()

    first = threading.Thread(target=slow)
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=duplicate)
    second.start()
    second.join(0.5)  # waits on the first one's uncommitted marker (or the SQLite lock)
    release.set()
    first.join(30)
    second.join(30)
    assert outcome == {"ran": False}
    assert list(Widget.objects.values_list("name", flat=True)) == ["slow"]
