"""``@idempotent_function``: a plain callable (a Celery task included) run once per key, its
return value stored and replayed, under the leases and fencing of the request lifecycle.

Real threads with their own database connections for concurrency and takeovers; the database's
clock (records aged with ``age_record``) for expiry.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection, connections, transaction

from django_idempotency import idempotent_function as exported
from django_idempotency.core.types import Identity, Proceed
from django_idempotency.db import database_now
from django_idempotency.db.querysets import COMPLETED
from django_idempotency.exceptions import (
    IdempotentCallInProgress,
    IdempotentCallKeyInvalid,
    IdempotentCallMismatch,
    IdempotentResultNotStorable,
    LeaseLost,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request import lifecycle
from django_idempotency.request.decorators import idempotent_function
from django_idempotency.request.idempotent_function import CALL_METHOD, RESULT_CONTENT_TYPE
from tests.support.factories import age_record, held_elsewhere
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

ON_SQLITE = connection.vendor == "sqlite"
#: A fingerprint=None function's fingerprint: the digest of nothing compared.
UNCOMPARED = hashlib.sha256(b"null").hexdigest()

calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    calls.clear()


def scope_of(function: Any) -> str:
    return f"function:{function.__module__}.{function.__qualname__}"


@idempotent_function(key="order_id")
def charge(order_id: int, amount: Decimal, note: str = "") -> dict[str, Any]:
    calls["charge"] += 1
    widget = Widget.objects.create(name=f"charge-{order_id}")
    return {"widget": widget.pk, "amount": amount, "note": note}


# --- once, replayed ---------------------------------------------------------------------------


def test_the_first_call_runs_and_a_repeat_returns_the_stored_value_without_running():
    first = charge(7, Decimal("10.00"))
    again = charge(7, Decimal("10.00"))
    assert calls["charge"] == 1
    assert Widget.objects.filter(name="charge-7").count() == 1
    # Every call returns what a replay returns: the value after a trip through JSON.
    assert first == again == {"widget": first["widget"], "amount": "10.00", "note": ""}
    record = IdempotencyRecord.objects.get(scope=scope_of(charge), key="7")
    assert record.status == COMPLETED
    assert record.method == CALL_METHOD
    assert record.path == "tests.request.test_idempotent_function.charge"
    assert record.response_status == 200
    assert record.response_headers == [["Content-Type", RESULT_CONTENT_TYPE]]
    assert (
        bytes(record.response_body)
        == b'{"widget":%d,"amount":"10.00","note":""}' % (first["widget"])
    )


def test_another_key_runs_again():
    charge(1, Decimal("1"))
    charge(2, Decimal("1"))
    assert calls["charge"] == 2
    assert Widget.objects.count() == 2


def test_two_functions_never_share_keys():
    @idempotent_function(key="order_id")
    def refund(order_id: int, amount: Decimal, note: str = "") -> str:
        calls["refund"] += 1
        return "refunded"

    charge(3, Decimal("1"))
    assert refund(3, Decimal("1")) == "refunded"
    assert calls == {"charge": 1, "refund": 1}
    assert IdempotencyRecord.objects.filter(key="3").count() == 2


def test_an_explicit_scope_is_shared_by_the_functions_that_name_it():
    @idempotent_function(key="n", scope="shared")
    def one(n: int) -> str:
        return "one"

    @idempotent_function(key="n", scope="shared")
    def two(n: int) -> str:
        return "two"

    assert one(1) == "one"
    assert two(1) == "one"  # same scope, key and arguments: a repeat
    assert IdempotencyRecord.objects.get(key="1").scope == "shared"


def test_the_decorator_is_exported_from_the_package_and_keeps_the_signature():
    assert exported is idempotent_function
    assert charge.__name__ == "charge"
    assert str(inspect.signature(charge)) == str(inspect.signature(charge.__wrapped__))


# --- failures ---------------------------------------------------------------------------------


class Declined(Exception):
    pass


@idempotent_function(key="order_id")
def charge_or_fail(order_id: int, fail: bool) -> str:
    calls["charge_or_fail"] += 1
    Widget.objects.create(name=f"attempt-{order_id}")
    if fail:
        raise Declined("card declined")
    return "charged"


def test_an_exception_rolls_back_the_writes_releases_the_key_and_is_raised(released):
    with pytest.raises(Declined):
        charge_or_fail(5, True)
    assert not Widget.objects.exists()
    assert not IdempotencyRecord.objects.exists()
    assert released == [(scope_of(charge_or_fail), "5", "exception")]


def test_after_an_exception_a_later_call_runs_again():
    with pytest.raises(Declined):
        charge_or_fail(5, fail=True)
    # fail=True and fail=False are different arguments: compare only the order here.
    calls.clear()

    @idempotent_function(key="order_id", fingerprint=lambda order_id, fail: order_id)
    def retried(order_id: int, fail: bool) -> str:
        calls["retried"] += 1
        if fail:
            raise Declined("card declined")
        Widget.objects.create(name="retried")
        return "charged"

    with pytest.raises(Declined):
        retried(5, True)
    assert retried(5, False) == "charged"
    assert retried(5, False) == "charged"
    assert calls["retried"] == 2
    assert Widget.objects.filter(name="retried").count() == 1


def test_a_rollback_asked_for_inside_the_function_stores_nothing(released):
    @idempotent_function(key="n")
    def rolls_back(n: int) -> str:
        calls["rolls_back"] += 1
        Widget.objects.create(name="rolled")
        transaction.set_rollback(True)
        return "not kept"

    assert rolls_back(1) == "not kept"
    assert rolls_back(1) == "not kept"
    assert calls["rolls_back"] == 2
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()
    assert [reason for *_, reason in released] == ["rolled_back", "rolled_back"]


class Unserializable:
    pass


@idempotent_function(key="n", fingerprint=None)
def returns(n: int, value: Any) -> Any:
    calls["returns"] += 1
    Widget.objects.create(name=f"returns-{n}")
    return value


def test_a_value_the_serializer_cannot_store_rolls_back_and_releases():
    with pytest.raises(IdempotentResultNotStorable, match="serializer cannot store") as caught:
        returns(1, Unserializable())
    assert isinstance(caught.value.__cause__, TypeError)
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()
    with pytest.raises(IdempotentResultNotStorable):
        returns(1, float("nan"))  # JSON has no NaN: refused rather than stored as invalid JSON
    assert not IdempotencyRecord.objects.exists()


def test_a_value_larger_than_max_response_bytes_is_not_stored(idempotency_settings):
    idempotency_settings(MAX_RESPONSE_BYTES=100)
    with pytest.raises(IdempotentResultNotStorable, match="MAX_RESPONSE_BYTES"):
        returns(1, "x" * 200)
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()
    assert returns(1, "x" * 50) == "x" * 50


# --- arguments --------------------------------------------------------------------------------


def test_the_same_key_with_other_arguments_is_refused_and_nothing_runs():
    charge(9, Decimal("10.00"))
    with pytest.raises(IdempotentCallMismatch, match="different arguments"):
        charge(9, Decimal("99.00"))
    with pytest.raises(IdempotentCallMismatch):
        charge(9, Decimal("10.00"), note="other")
    assert calls["charge"] == 1


def test_arguments_compare_by_value_not_by_how_they_are_passed():
    first = charge(9, Decimal("10.00"))
    assert charge(order_id=9, amount=Decimal("10.00"), note="") == first
    assert calls["charge"] == 1


def test_fingerprint_none_compares_no_arguments():
    @idempotent_function(key="n", fingerprint=None)
    def first_wins(n: int, value: str) -> str:
        return value

    assert first_wins(1, "a") == "a"
    assert first_wins(1, "b") == "a"


def test_model_instances_compare_by_primary_key_and_arguments_that_json_cannot_hold_say_so():
    widget = Widget.objects.create(name="order")

    @idempotent_function(key="order.pk")
    def ship(order: Widget, extra: Any = None) -> str:
        calls["ship"] += 1
        return order.name

    assert ship(widget) == "order"
    assert ship(Widget.objects.get(pk=widget.pk)) == "order"  # another instance, same row
    assert calls["ship"] == 1
    with pytest.raises(TypeError, match="fingerprint="):
        ship(widget, extra=object())


def test_a_bound_tasks_self_is_not_compared():
    class Task:
        name = "task"

    @idempotent_function(key="order_id")
    def bound(self: Any, order_id: int) -> str:
        calls["bound"] += 1
        return "done"

    assert bound(Task(), 1) == bound(Task(), 1) == "done"
    assert calls["bound"] == 1


# --- keys -------------------------------------------------------------------------------------


@dataclass
class Order:
    id: int
    lines: list[dict[str, Any]]


def test_a_dotted_path_reads_attributes_items_and_indexes():
    @idempotent_function(key="order.id")
    def by_attribute(order: Order) -> str:
        return "attribute"

    @idempotent_function(key="payload.order_id")
    def by_item(payload: dict[str, Any]) -> str:
        return "item"

    @idempotent_function(key="order.lines.0.sku", fingerprint=None)
    def by_index(order: Order) -> str:
        return "index"

    @idempotent_function(key="order_id")
    def by_keyword(**kwargs: Any) -> str:
        return "keyword"

    by_attribute(Order(11, []))
    by_item({"order_id": "A-12", "total": 3})
    by_index(Order(13, [{"sku": "sku-13"}]))
    by_keyword(order_id=uuid.UUID(int=14))
    keys = dict(IdempotencyRecord.objects.values_list("path", "key"))
    prefix = (
        "tests.request.test_idempotent_function."
        "test_a_dotted_path_reads_attributes_items_and_indexes"
    )
    assert keys == {
        f"{prefix}.<locals>.by_attribute": "11",
        f"{prefix}.<locals>.by_item": "A-12",
        f"{prefix}.<locals>.by_index": "sku-13",
        f"{prefix}.<locals>.by_keyword": str(uuid.UUID(int=14)),
    }


def test_a_callable_key_takes_the_functions_arguments():
    @idempotent_function(key=lambda customer, order, **_: f"{customer}:{order}")
    def place(customer: int, order: int, rush: bool = False) -> str:
        calls["place"] += 1
        return "placed"

    place(1, 2)
    place(customer=1, order=2)
    place(1, 3)
    assert calls["place"] == 2
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"1:2", "1:3"}


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("customer", "not a parameter"),
        ("order..id", "not a dotted path"),
        ("", "not a dotted path"),
        (42, "must be a dotted path"),
    ],
)
def test_a_key_that_can_never_be_read_is_refused_at_decoration(key, message):
    with pytest.raises(TypeError, match=message):

        @idempotent_function(key=key)
        def f(order: Order) -> None: ...


@pytest.mark.parametrize(("option", "value"), [("ttl", 0), ("lease", -1), ("ttl", True)])
def test_durations_must_be_positive(option, value):
    with pytest.raises(ValueError, match=option):
        idempotent_function(key="n", **{option: value})


def test_a_serializer_must_have_dumps_and_loads():
    with pytest.raises(TypeError, match="serializer"):
        idempotent_function(key="n", serializer=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        (Order(1, []), "has no attribute 'customer'"),
        ({"id": 1}, "has no item 'customer'"),
        (Order(None, []), "gave NoneType"),  # type: ignore[arg-type]
        (Order("x" * 256, []), "1 to 255 characters"),  # type: ignore[arg-type]
        (Order(True, []), "gave bool"),  # type: ignore[arg-type]
    ],
)
def test_a_key_that_cannot_be_read_from_a_call_is_refused_before_claiming(argument, message):
    @idempotent_function(key="order.customer" if "customer" in message else "order.id")
    def f(order: Any) -> None:
        calls["f"] += 1

    with pytest.raises(IdempotentCallKeyInvalid, match=message):
        f(argument)
    assert not calls and not IdempotencyRecord.objects.exists()


# --- leases, concurrency, fencing -------------------------------------------------------------


def test_a_call_whose_key_is_held_elsewhere_raises_in_progress_with_the_lease_left():
    @idempotent_function(key="n", fingerprint=None, lease=20)
    def held(n: int) -> str:
        calls["held"] += 1
        return "ran"

    ident = Identity(scope_of(held), "1", UNCOMPARED, CALL_METHOD, "elsewhere")
    with held_elsewhere(ident) as claimed:
        assert isinstance(claimed, Proceed)
        with pytest.raises(IdempotentCallInProgress) as caught:
            held(1)
    assert 1 <= caught.value.retry_after <= 30
    assert "call again in" in str(caught.value)
    assert not calls


@idempotent_function(key="n")
def slow_effect(n: int, hold: float) -> int:
    calls["slow_effect"] += 1
    widget = Widget.objects.create(name=f"slow-{n}")
    time.sleep(hold)
    return widget.pk


def call_from_threads(count: int, function: Any, *args: Any) -> list[Any]:
    """Call ``function(*args)`` from ``count`` threads released at once, each on a database
    connection of its own; the results, or the exceptions raised."""
    start = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(index: int) -> None:
        try:
            start.wait(30)
            results[index] = function(*args)
        except BaseException as exc:
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def test_concurrent_calls_with_one_key_run_it_once():
    refused = threading.Event()

    @idempotent_function(key="n")
    def held_effect(n: int) -> int:
        calls["held_effect"] += 1
        widget = Widget.objects.create(name=f"held-{n}")
        if ON_SQLITE:  # one writer at a time: the others wait for this call's commit anyway
            time.sleep(0.5)
        else:  # runs until another call was refused, however late the others come
            refused.wait(30)
        return widget.pk

    def call() -> int:
        try:
            return held_effect(1)
        except IdempotentCallInProgress:
            refused.set()
            raise

    results = call_from_threads(8, call)
    assert calls["held_effect"] == 1
    assert Widget.objects.filter(name="held-1").count() == 1
    (pk,) = Widget.objects.values_list("pk", flat=True)
    for result in results:
        assert result == pk or isinstance(result, IdempotentCallInProgress), result
    assert results.count(pk) >= 1
    if not ON_SQLITE:
        # SQLite serializes the writers: the others wait for the first to commit and replay.
        assert any(isinstance(result, IdempotentCallInProgress) for result in results)
    assert held_effect(1) == pk


def test_concurrent_calls_with_different_keys_all_run():
    results = call_from_threads(4, lambda: slow_effect(uuid.uuid4().int % 10**9, 0.1))
    assert all(isinstance(result, int) for result in results), results
    assert calls["slow_effect"] == 4


@pytest.mark.skipif(ON_SQLITE, reason="SQLite has one writer: no takeover while a call runs")
def test_a_call_whose_lease_was_taken_over_rolls_back_and_raises_lease_lost(released):
    taken: list[Any] = []

    @idempotent_function(key="n", fingerprint=None, lease=1, heartbeat=False)
    def overruns(n: int) -> str:
        Widget.objects.create(name="overran")
        time.sleep(1.3)  # past the lease: another call may take the key over now
        ident = Identity(scope_of(overruns), "1", UNCOMPARED, CALL_METHOD, "other")
        thread = threading.Thread(target=lambda: taken.append(take_over(ident)))
        thread.start()
        thread.join(30)
        return "too late"

    with pytest.raises(LeaseLost, match="took it over"):
        overruns(1)
    (decision,) = taken
    assert isinstance(decision, Proceed) and decision.lease.taken_over
    assert not Widget.objects.exists()  # the overrun call's writes rolled back
    record = IdempotencyRecord.objects.get(key="1")
    assert record.owner_token == decision.lease.owner_token  # the new owner keeps the key
    assert released == []  # the key is not ours to release any more


def take_over(ident: Identity) -> Any:
    try:
        return lifecycle.claim(ident)
    finally:
        connections.close_all()


@pytest.mark.skipif(ON_SQLITE, reason="SQLite has no heartbeat: one writer at a time")
@pytest.mark.parametrize("heartbeat", [True, False], ids=["heartbeat", "control-without"])
def test_the_heartbeat_keeps_a_long_call_its_key(heartbeat: bool):
    running, finish = threading.Event(), threading.Event()

    @idempotent_function(key="n", lease=1, heartbeat=heartbeat)
    def long_call(n: int) -> str:
        calls["long_call"] += 1
        if calls["long_call"] == 1:
            running.set()
            finish.wait(30)  # the first call runs until the second one has been tried
        return "finished"

    outcome: list[Any] = []
    first = threading.Thread(target=lambda: outcome.extend(call_from_threads(1, long_call, 1)))
    first.start()
    try:
        assert running.wait(30)
        time.sleep(2)  # twice the lease: without the heartbeat the key can be taken over
        if heartbeat:
            with pytest.raises(IdempotentCallInProgress):
                long_call(1)
        else:
            assert long_call(1) == "finished"  # taken over: the second call ran it
    finally:
        finish.set()
        first.join(30)
    if heartbeat:
        assert outcome == ["finished"]
        assert long_call(1) == "finished"
        assert calls["long_call"] == 1
    else:
        assert isinstance(outcome[0], LeaseLost)
        assert calls["long_call"] == 2


# --- lease and TTL ----------------------------------------------------------------------------


def test_ttl_and_lease_are_the_functions_and_measured_by_the_database():
    @idempotent_function(key="n", ttl=3600, lease=5)
    def timed(n: int) -> dict[str, Any]:
        record = IdempotencyRecord.objects.get(key=str(n))
        return {"lease_left": (record.lease_expires_at - database_now("default")).total_seconds()}

    lease_left = timed(1)["lease_left"]
    assert 0 < lease_left <= 5
    record = IdempotencyRecord.objects.get(key="1")
    expected = database_now("default") + timedelta(seconds=3600)
    assert abs(record.expires_at - expected) < timedelta(seconds=10)


def test_after_its_ttl_a_key_runs_again():
    @idempotent_function(key="n", ttl=60)
    def expires(n: int) -> int:
        calls["expires"] += 1
        return calls["expires"]

    assert expires(1) == 1
    age_record(scope_of(expires), "1", 59)
    assert expires(1) == 1  # still within its TTL: replayed
    age_record(scope_of(expires), "1", 2)
    assert expires(1) == 2  # past it: the record counts as absent
    assert IdempotencyRecord.objects.get(key="1").attempts == 1


def test_a_call_that_died_is_taken_over_after_its_lease():
    @idempotent_function(key="n", fingerprint=None, lease=30)
    def resumed(n: int) -> str:
        calls["resumed"] += 1
        return "resumed"

    ident = Identity(scope_of(resumed), "1", UNCOMPARED, CALL_METHOD, "dead")
    decision = take_over(ident)  # claimed on a connection that is now closed: a dead caller
    assert isinstance(decision, Proceed)
    age_record(ident.scope, ident.key, 31)
    assert resumed(1) == "resumed"
    record = IdempotencyRecord.objects.get(key="1")
    assert record.status == COMPLETED and record.attempts == 2


# --- placement --------------------------------------------------------------------------------


def test_inside_a_callers_transaction_it_runs_in_a_savepoint():
    with transaction.atomic():
        first = charge(21, Decimal("1"))
        assert charge(21, Decimal("1")) == first
    assert calls["charge"] == 1
    assert IdempotencyRecord.objects.get(key="21").status == COMPLETED


def test_inside_a_callers_transaction_that_rolls_back_nothing_is_kept():
    with pytest.raises(Declined), transaction.atomic():
        charge(22, Decimal("1"))
        raise Declined("the caller failed after the call")
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()


@idempotent_function(key="n")
async def async_effect(n: int) -> str:
    calls["async_effect"] += 1
    widget = await sync_to_async(Widget.objects.create)(name=f"async-{n}")
    return f"widget {widget.pk}"


def test_an_async_function_runs_once_with_its_writes_in_the_transaction():
    first = async_to_sync(async_effect)(1)
    assert async_to_sync(async_effect)(1) == first
    assert calls["async_effect"] == 1
    assert Widget.objects.filter(name="async-1").count() == 1
    assert inspect.iscoroutinefunction(async_effect)


def test_an_async_function_that_raises_rolls_back():
    @idempotent_function(key="n")
    async def async_fails(n: int) -> None:
        await sync_to_async(Widget.objects.create)(name="async-fail")
        raise Declined("no")

    with pytest.raises(Declined):
        async_to_sync(async_fails)(1)
    assert not Widget.objects.exists() and not IdempotencyRecord.objects.exists()


def test_a_custom_serializer_stores_and_reads_the_value():
    class Text:
        content_type = "text/plain"

        def dumps(self, value: Any) -> bytes:
            return str(value).encode()

        def loads(self, data: bytes) -> Any:
            return data.decode()

    @idempotent_function(key="n", serializer=Text())
    def text(n: int) -> int:
        return n * 2

    assert text(4) == text(4) == "8"
    record = IdempotencyRecord.objects.get(key="4")
    assert record.response_headers == [["Content-Type", "text/plain"]]


def test_with_the_redis_copy_a_repeat_is_replayed_without_a_query(
    settings, redis_url, django_assert_num_queries
):
    from django_redis import get_redis_connection

    from django_idempotency.request import redis_copy
    from tests.request.test_redis_copy import ALIAS, configure

    prefix = configure(settings, redis_url)
    client = get_redis_connection(ALIAS)
    try:

        @idempotent_function(key="n", ttl=600)
        def cached(n: int) -> dict[str, int]:
            calls["cached"] += 1
            return {"n": n}

        assert cached(1) == {"n": 1}
        copy = redis_copy.redis_key(scope_of(cached), "1")
        assert client.pttl(copy) < 0  # no copy until the first repeat
        assert cached(1) == {"n": 1}  # from the database, then copied to Redis
        assert 0 < client.pttl(copy) <= 600_000  # the copy expires with the function's TTL
        with django_assert_num_queries(0):
            assert cached(1) == {"n": 1}
        assert calls["cached"] == 1
    finally:
        for name in client.scan_iter(f"{prefix}:*"):
            client.delete(name)


@pytest.mark.django_db(transaction=True, databases=["default", "records"])
def test_with_the_records_in_another_database_the_writes_commit_with_the_stored_value():
    from django.test import override_settings

    with override_settings(DATABASE_ROUTERS=["tests.support.routers.RecordsElsewhere"]):
        with pytest.raises(Declined):
            charge_or_fail(31, True)
        assert not Widget.objects.exists(), "the function's write outlived its exception"
        assert not IdempotencyRecord.objects.using("records").exists()

        @idempotent_function(key="n", using="default")
        def writes_default(n: int) -> int:
            return Widget.objects.create(name="elsewhere").pk

        pk = writes_default(1)
        assert writes_default(1) == pk
        assert Widget.objects.get().pk == pk
        assert IdempotencyRecord.objects.using("records").get().status == COMPLETED
        assert not IdempotencyRecord.objects.using("default").exists()


def test_a_record_that_holds_no_function_result_is_not_taken_for_one():
    from django_idempotency.exceptions import IdempotentFunctionError
    from tests.support.factories import IdempotencyRecordFactory

    @idempotent_function(key="n", fingerprint=None, scope="user:1")
    def shares_a_views_scope(n: int) -> str:
        return "ran"

    IdempotencyRecordFactory(scope="user:1", key="1", fingerprint=UNCOMPARED)  # a view's 201
    with pytest.raises(IdempotentFunctionError, match="holds no function result"):
        shares_a_views_scope(1)
