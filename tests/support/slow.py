"""Helpers of the end-to-end checks that build environments of their own (packaging, the quick
start, the how-tos). What they check does not depend on the database or the Django series the
suite runs with, so they are marked ``once``: ``make test`` runs them in its reference pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


#: Mark a module that builds environments of its own: run once per ``make test``, never in
#: ``make test-quick``.
once_per_run = [pytest.mark.slow, pytest.mark.once]


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
