"""schemathesis against the demo's OpenAPI schema: every check, a fixed seed, a bounded number of
examples, on SQLite. No answer may be a 5xx or contradict the schema (status, content type,
headers, body); what the schema cannot express is told in ``schemathesis.toml`` and docs/demo.md.

The summary is printed (``-s`` shows it; it is also in the failure message).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.demo.conftest import DemoServer, serving
from tests.support.slow import once_per_run

pytestmark = once_per_run

CONFIG = Path(__file__).with_name("schemathesis.toml")
SEED = 20240611
MAX_EXAMPLES = 50


@pytest.fixture(scope="module")
def fresh_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    """A demo server of its own: schemathesis moves money between all the seeded accounts."""
    with serving(tmp_path_factory.mktemp("schemathesis")) as server:
        yield server


def test_the_demo_meets_its_schema(fresh_demo: DemoServer, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(CONFIG),
            "run",
            f"{fresh_demo.url}/api/schema/?format=json",
            "--checks",
            "all",
            "--seed",
            str(SEED),
            "--max-examples",
            str(MAX_EXAMPLES),
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--no-color",
        ],
        cwd=tmp_path,  # its report and cache directories go there
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    summary = output[output.find("=== SUMMARY") :] if "=== SUMMARY" in output else output
    print("\nschemathesis:\n" + summary)
    assert result.returncode == 0, output
    assert "Selected: 12/12" in output
