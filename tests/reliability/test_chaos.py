"""The short chaos run (``make chaos`` in a minute): the hard guarantees, under every fault at
once, on each database.

Worker kills, a database restart and outage, a Redis kill and a relay kill, under retrying
clients against the demo (tests/reliability/chaos.py). Asserted: no duplicate or lost payment,
exact balances, no stuck key, every event published and consumed once, no 5xx outside a window
where the database itself was down. The timings (409 streaks, commit → publish) are printed,
never asserted: the machine's speed is not under test.

Each run brings its own private server (a PostgreSQL cluster, a MariaDB), so both run whatever
``TEST_DATABASE`` the rest of the suite uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.chaos import DATABASES, SHORT, ChaosConfig, missing_tools, named, run


@pytest.mark.parametrize("database", list(DATABASES))
def test_short_chaos_run_keeps_every_effect_exactly_once(
    database: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if missing := missing_tools(database):
        pytest.skip(f"not installed: {', '.join(missing)}")
    report = run(ChaosConfig.short(logs=tmp_path / "logs"), database)
    (tmp_path / "chaos.json").write_text(json.dumps(report.as_json(), default=str))
    with capsys.disabled():
        print(f"\n{report.table()}")

    assert not report.violations(), "\n".join(report.violations()[:40])
    # The run did what it says: every fault struck, under load, and the checks saw effects.
    label = DATABASES[database]
    assert [fault["kind"] for fault in report.faults] == [
        named(planned.kind, label) for planned in SHORT
    ]
    figures = report.figures
    assert figures["payments"] > 100
    assert figures["events"] == figures["payments"]
    assert figures["5xx_inside_db_down"] > 0, "no client saw the database go away"
    assert "inside a payment's transaction" in " ".join(f["detail"] for f in report.faults)
