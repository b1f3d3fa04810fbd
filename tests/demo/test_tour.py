"""``manage.py idempotency_tour`` against a live demo server, as the README says to run it: as
``make demo`` serves it (in-process consumer) and as docker compose runs it (RabbitMQ and a
Celery worker, in the PostgreSQL pass)."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

import pytest

from tests.demo import stack
from tests.demo.conftest import DemoServer
from tests.support.ports import free_port


def tour(url: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The tour; with the server's ``env`` it shares the server's database and services, as
    ``make tour`` shares ``make demo``'s, so its closing ``idempotency_verify`` checks them."""
    return subprocess.run(
        [sys.executable, "manage.py", "idempotency_tour", "--url", url],
        env=env or stack.environment(),
        cwd=stack.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(params=["in-process", "worker"])
def toured(request: pytest.FixtureRequest) -> DemoServer:
    if request.param == "in-process":
        server: DemoServer = request.getfixturevalue("demo_server")
        return server
    return request.getfixturevalue("broker_stack").server  # type: ignore[no-any-return]


def ledger(server: DemoServer, account: str) -> list[dict[str, str]]:
    answer = server.client().request("GET", f"/api/v1/ledger/?account={account}")
    assert answer.status == 200
    entries: list[dict[str, str]] = answer.body
    return entries


def test_the_tour_runs_green_and_every_duplicate_leaves_the_balances_alone(
    toured: DemoServer,
) -> None:
    before = toured.balances()
    seen = {entry["id"] for entry in ledger(toured, "acc_1")}
    result = tour(toured.url, toured.env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "The tour ran green." in result.stdout
    assert result.stderr == ""  # no bare log lines around the tour's own report
    # It ends with the guarantees checked on the same stack.
    assert "The guarantees on this stack" in result.stdout
    assert "Every check passed." in result.stdout
    assert "skipped" not in result.stdout  # the server has faults on: every step ran
    for answer in ("201 replayed", "409 transaction_in_progress", "422 payload_mismatch"):
        assert answer in result.stdout
    assert "no answer: the connection was dropped" in result.stdout
    # The payments' retries go through django_idempotency.client, and the first payment's key
    # is looked up by the status endpoint (its Link followed; an unknown key is 404).
    assert "retried by the client" in result.stdout
    assert "the key is completed, with a Link to its stored response" in result.stdout
    assert "404 idempotency_key_not_found" in result.stdout
    # The payout: 202 at once, then a duplicate that waited for the worker got its 201.
    assert "accepted at once (202), Location: the key's status URL" in result.stdout
    assert "the duplicate attached: it waited for the worker and got the payout" in result.stdout
    assert "the key is completed: the payout's answer is stored under it, once" in result.stdout
    # Paid 25.00, 10.00, 5.00 and the 7.00 payout once each, whatever the duplicates, and
    # refunded the 25.00.
    after = toured.balances()
    assert after["acc_1"] == before["acc_1"] - Decimal("22.00")
    assert after["acc_2"] == before["acc_2"] + Decimal("22.00")
    # The ledger, written by the consumer: one event per payment and one for the refund, each
    # with one debit and one credit. Nothing for the duplicates or for the crashed attempt.
    new = [entry for entry in ledger(toured, "acc_1") if entry["id"] not in seen]
    assert sorted((e["topic"], e["side"], e["amount"]) for e in new) == [
        ("payment.completed", "debit", "10.00"),
        ("payment.completed", "debit", "25.00"),
        ("payment.completed", "debit", "5.00"),
        ("payment.completed", "debit", "7.00"),
        ("payment.refunded", "credit", "25.00"),
    ]
    assert len({entry["event_id"] for entry in new}) == 5
    for entry in new:
        pair = toured.client().ledger(entry["payment"])
        event = [e for e in pair if e["event_id"] == entry["event_id"]]
        assert sorted((e["side"], e["account"]) for e in event) == (
            [("credit", "acc_2"), ("debit", "acc_1")]
            if entry["side"] == "debit"
            else [("credit", "acc_1"), ("debit", "acc_2")]
        )
    # The server survived the crash it was put through.
    assert toured.client().request("GET", "/api/v1/demo/").status == 200


def test_the_tour_says_so_when_there_is_no_demo_to_tour() -> None:
    result = tour(f"http://127.0.0.1:{free_port()}")
    assert result.returncode != 0
    assert "Cannot reach the demo" in result.stderr
    assert "make demo" in result.stderr
