"""The ledger through the live demo server (no broker): each payment's event is relayed and
consumed in the server's process, once, however often the request was retried."""

from __future__ import annotations

import uuid
from typing import Any

from demo_project.payments import services
from demo_project.payments.models import Payment
from tests.demo.conftest import DemoServer
from tests.demo.test_api import new_key, pay


def summary(entries: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    return sorted((e["topic"], e["side"], e["account"], e["amount"]) for e in entries)


def event_id(topic: str, transaction_id: str) -> str:
    return str(services.event_id(topic, Payment(transaction_id=uuid.UUID(transaction_id))))


def settled_ledger(server: DemoServer, transaction_id: str, count: int) -> list[dict[str, Any]]:
    """The payment's entries, read once a later payment from the same account reached the
    ledger too: that event left after this one (same key), and in-process the relay only sends
    the next event once the consumer has finished with the last. With a worker, it gives a
    duplicate delivery time to show."""
    later = pay(server, new_key(), "1.00")
    server.ledger(later.body["transaction_id"], count=2)
    return server.ledger(transaction_id, count=count)


def test_a_payment_and_its_retries_reach_the_ledger_once(demo_server: DemoServer) -> None:
    key = new_key()
    first = pay(demo_server, key, "17.00")
    assert first.status == 201, first.body
    assert all(pay(demo_server, key, "17.00").replayed for _ in range(3))
    transaction_id = first.body["transaction_id"]
    entries = settled_ledger(demo_server, transaction_id, count=2)
    assert summary(entries) == [
        ("payment.completed", "credit", "acc_4", "17.00"),
        ("payment.completed", "debit", "acc_3", "17.00"),
    ]
    assert {entry["event_id"] for entry in entries} == {
        event_id(services.PAYMENT_COMPLETED, transaction_id)
    }
    assert {entry["payment"] for entry in entries} == {transaction_id}


def test_a_refund_and_its_retry_add_the_reverse_pair_once(demo_server: DemoServer) -> None:
    transaction_id = pay(demo_server, new_key(), "8.00").body["transaction_id"]
    client = demo_server.client()
    key = new_key()
    path = f"/api/v1/payments/{transaction_id}/"
    for _ in range(2):
        answer = client.request("PATCH", path, {"status": "refunded"}, {"Idempotency-Key": key})
        assert answer.status == 200, answer.body
    entries = settled_ledger(demo_server, transaction_id, count=4)
    assert summary(entries) == [
        ("payment.completed", "credit", "acc_4", "8.00"),
        ("payment.completed", "debit", "acc_3", "8.00"),
        ("payment.refunded", "credit", "acc_3", "8.00"),
        ("payment.refunded", "debit", "acc_4", "8.00"),
    ]
    refunds = {e["event_id"] for e in entries if e["topic"] == services.PAYMENT_REFUNDED}
    assert refunds == {event_id(services.PAYMENT_REFUNDED, transaction_id)}


def test_an_event_left_claimed_by_a_dead_relay_goes_out_without_another_commit(
    demo_server: DemoServer,
) -> None:
    """The in-process beat: no kick comes (nothing else commits), yet the event goes out."""
    transaction_id = pay(demo_server, new_key(), "3.00").body["transaction_id"]
    first = {entry["id"] for entry in demo_server.ledger(transaction_id, count=2)}
    # Back to how a relay that claimed the event and died before publishing it leaves things:
    # leased for a moment longer, consumed by nobody.
    demo_server.django(
        "import uuid\n"
        "from datetime import timedelta\n"
        "from django.utils import timezone\n"
        "from demo_project.payments.models import LedgerEntry\n"
        "from django_idempotency.models import OutboxEvent, ProcessedMessage\n"
        f"event_id = '{event_id(services.PAYMENT_COMPLETED, transaction_id)}'\n"
        "LedgerEntry.objects.filter(event_id=event_id).delete()\n"
        "ProcessedMessage.objects.filter(message_id=event_id).delete()\n"
        "OutboxEvent.objects.filter(event_id=event_id).update(\n"
        "    status='PENDING', relay_token=uuid.uuid4(),\n"
        "    locked_until=timezone.now() + timedelta(seconds=2))\n"
    )
    # The entries were deleted with the marker: what the ledger shows now, the event wrote again.
    # (Not "empty first": the relay may release a gone relay's batch before the next read.)
    again = demo_server.ledger(transaction_id, count=2)
    assert not first & {entry["id"] for entry in again}
    assert summary(again) == [
        ("payment.completed", "credit", "acc_4", "3.00"),
        ("payment.completed", "debit", "acc_3", "3.00"),
    ]


def test_the_ledger_is_read_only_and_filters(demo_server: DemoServer) -> None:
    client = demo_server.client()
    transaction_id = pay(demo_server, new_key(), "2.00").body["transaction_id"]
    entries = demo_server.ledger(transaction_id, count=2)
    assert client.request("POST", "/api/v1/ledger/", {"side": "credit"}).status == 405
    detail = f"/api/v1/ledger/{entries[0]['id']}/"
    assert client.request("GET", detail).body == entries[0]
    assert client.request("DELETE", detail).status == 405
    by_account = client.request("GET", "/api/v1/ledger/?account=acc_4").body
    assert {entry["account"] for entry in by_account} == {"acc_4"}
    assert next(entry for entry in entries if entry["account"] == "acc_4") in by_account
    refused = client.request("GET", "/api/v1/ledger/?payment=not-a-uuid")
    assert refused.status == 400
    assert "transaction_id" in str(refused.body["payment"])
