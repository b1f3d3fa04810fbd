"""The ledger on the real stack: RabbitMQ and a Celery worker started with docker-compose.yml's
command (PostgreSQL pass). The relay sends each event as a task whose id is the event id; the
worker writes one pair of entries per event, whatever the broker and the relay do twice."""

from __future__ import annotations

from tests.demo import stack
from tests.demo.conftest import BrokerStack
from tests.demo.test_api import new_key, pay
from tests.demo.test_ledger import event_id, settled_ledger, summary

PAID = [
    ("payment.completed", "credit", "acc_4", "20.00"),
    ("payment.completed", "debit", "acc_3", "20.00"),
]


def test_the_worker_writes_one_pair_per_event(broker_stack: BrokerStack) -> None:
    server = broker_stack.server
    key = new_key()
    first = pay(server, key, "20.00")
    assert first.status == 201, first.body
    assert all(pay(server, key, "20.00").replayed for _ in range(2))
    transaction_id = first.body["transaction_id"]
    path = f"/api/v1/payments/{transaction_id}/"
    refund_key = new_key()
    for _ in range(2):
        refunded = server.client().request(
            "PATCH", path, {"status": "refunded"}, {"Idempotency-Key": refund_key}
        )
        assert refunded.status == 200, refunded.body
    entries = server.ledger(transaction_id, count=4)
    assert summary(entries) == [
        *PAID,
        ("payment.refunded", "credit", "acc_3", "20.00"),
        ("payment.refunded", "debit", "acc_4", "20.00"),
    ]
    assert server.client().request("GET", "/api/v1/demo/").body["broker"] is True


def test_a_worker_killed_mid_task_leaves_one_pair(broker_stack: BrokerStack) -> None:
    server = broker_stack.server
    answer = pay(server, new_key(), "20.00", headers={"X-Demo-Fault": "crash-ledger"})
    assert answer.status == 201, answer.body
    transaction_id = answer.body["transaction_id"]
    # The worker process died after writing the entries, before its commit; the broker gave
    # the unacknowledged task to another, which wrote them: once.
    assert summary(server.ledger(transaction_id, count=2)) == PAID
    assert "signal 9" in broker_stack.worker_log.read_text()
    assert summary(settled_ledger(server, transaction_id, count=2)) == PAID


def test_an_event_the_relay_sends_again_is_skipped_by_the_worker(
    broker_stack: BrokerStack,
) -> None:
    server = broker_stack.server
    transaction_id = pay(server, new_key(), "20.00").body["transaction_id"]
    server.ledger(transaction_id, count=2)
    skipped = broker_stack.worker_log.read_text().count("duplicate message skipped")
    # As after a relay that published and died before its ack: PENDING again, sent again.
    server.django(
        "from django.core.management import call_command\n"
        "from django_idempotency.models import OutboxEvent\n"
        f"event_id = '{event_id('payment.completed', transaction_id)}'\n"
        "assert OutboxEvent.objects.filter(event_id=event_id).update(status='PENDING') == 1\n"
        "call_command('outbox_relay')\n"
    )
    worker_log = broker_stack.worker_log
    stack.wait_for(
        lambda: worker_log.read_text().count("duplicate message skipped") > skipped,
        "the worker to skip the event sent again",
    )
    assert summary(server.client().ledger(transaction_id)) == PAID
