"""The slow end-to-end checks (packaging, the quick start, schemathesis) run once per ``make
test``: in its SQLite pass on the oldest Django series the project supports. What they check
does not depend on the database or the Django series the suite runs with (they build their own
environments), so the other passes would only repeat them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import django
import pytest

from tests.settings import TEST_DATABASE

ROOT = Path(__file__).resolve().parent.parent
#: Files of the checkout that never belong in a copy of it. Besides being no sources, the
#: coverage data and the caches change while it is copied: the other passes of ``make test``,
#: running side by side, write and remove their ``.coverage.*`` files in the checkout.
NOT_SOURCES = (
    ".git",
    ".venv*",
    "build",
    "dist",
    "site",
    "artifacts",
    "*.egg-info",
    "__pycache__",
    ".coverage*",
    ".hypothesis",
    ".*_cache",
)


def oldest_django_series() -> tuple[int, int]:
    """The ``django>=X.Y`` of pyproject.toml's dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"django>=(\d+)\.(\d+)", requirement.replace(" ", "").lower())
        if match:
            return int(match[1]), int(match[2])
    raise AssertionError("pyproject.toml names no django>=X.Y dependency")


THIS_PASS = TEST_DATABASE == "sqlite" and django.VERSION[:2] == oldest_django_series()

#: Mark a module or test as slow and run it in one pass only.
once_per_run = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not THIS_PASS,
        reason=f"runs once per run: with TEST_DATABASE=sqlite on Django "
        f"{'.'.join(map(str, oldest_django_series()))}",
    ),
]


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Run a command; its output, or a failure that shows it."""
    result = subprocess.run(
        argv,
        cwd=cwd,
        env=env if env is not None else os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def fresh_venv(path: Path) -> Path:
    """A new virtual environment with this interpreter's Python, nothing installed; its bin/."""
    run([sys.executable, "-m", "venv", str(path)], cwd=path.parent)
    return path / "bin"


def venv_environment(bin_dir: Path) -> dict[str, str]:
    """The environment a shell has after activating the venv: its bin/ first on PATH, nothing
    of this test run's Python path or Django settings."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env
