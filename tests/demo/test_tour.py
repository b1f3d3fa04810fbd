"""``manage.py idempotency_tour`` against the live demo server, as the README says to run it."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

from tests.demo import stack
from tests.demo.conftest import DemoServer


def tour(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "idempotency_tour", "--url", url],
        env=stack.environment(),
        cwd=stack.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_tour_runs_green_and_every_duplicate_leaves_the_balances_alone(
    demo_server: DemoServer,
) -> None:
    before = demo_server.balances()
    result = tour(demo_server.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "The tour ran green." in result.stdout
    assert "skipped" not in result.stdout  # the server has faults on: every step ran
    for answer in ("201 replayed", "409 transaction_in_progress", "422 payload_mismatch"):
        assert answer in result.stdout
    assert "no answer: the connection was dropped" in result.stdout
    # Paid 25.00, 10.00 and 5.00 once each, whatever the duplicates, and refunded the 25.00.
    after = demo_server.balances()
    assert after["acc_1"] == before["acc_1"] - Decimal("15.00")
    assert after["acc_2"] == before["acc_2"] + Decimal("15.00")
    # The server survived the crash it was put through.
    assert demo_server.client().request("GET", "/api/v1/demo/").status == 200


def test_the_tour_says_so_when_there_is_no_demo_to_tour() -> None:
    result = tour(f"http://127.0.0.1:{stack.free_port()}")
    assert result.returncode != 0
    assert "Cannot reach the demo" in result.stderr
    assert "make demo" in result.stderr
