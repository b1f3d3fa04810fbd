"""The child processes the checks kill: spawned with the project's settings, read line by line,
and killed (``SIGKILL``, their whole process group) at the moment a check wants.

A child runs ``child(arguments)`` of the check's own module, after ``django.setup()``. Its
command line holds only that module's name and the check's arguments (scratch names, ids, a
topic, a lease), never a secret: any local user reads a process's command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from django.conf import settings

__all__ = ["ChildUnavailable", "await_line", "kill", "spawned"]


class ChildUnavailable(Exception):
    """No child process can load the project's settings; the message says why."""


@contextlib.contextmanager
def spawned(module: str, arguments: dict[str, Any]) -> Iterator[subprocess.Popen[bytes]]:
    """A child process running ``module``'s ``child(arguments)``, killed on the way out if it
    still runs."""
    process = subprocess.Popen(
        _child_command(module, arguments),
        env=_child_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def kill(process: subprocess.Popen[bytes]) -> None:
    """``SIGKILL`` to the child and its process group, and wait for it to be gone."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def await_line(process: subprocess.Popen[bytes], prefix: str, timeout: float) -> str:
    """The rest of the child's first stdout line that starts with ``prefix``."""
    assert process.stdout is not None and process.stderr is not None
    descriptor = process.stdout.fileno()
    buffered = b""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([descriptor], [], [], left)
        chunk = os.read(descriptor, 65536) if ready else b""
        if not chunk:
            break
        buffered += chunk
        for line in buffered.decode(errors="replace").splitlines(keepends=True):
            if line.startswith(prefix) and line.endswith("\n"):
                return line[len(prefix) :].strip()
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    error = process.stderr.read().decode(errors="replace").strip()
    last = error.splitlines()[-1] if error else "no output"
    raise RuntimeError(f"the child process never reached {prefix.strip()!r} ({last})")


def _child_command(module: str, arguments: dict[str, Any]) -> list[str]:
    script = (
        "import importlib, json, sys, django; django.setup(); "
        "importlib.import_module(sys.argv[1]).child(json.loads(sys.argv[2]))"
    )
    return [sys.executable, "-c", script, module, json.dumps(arguments)]


def _child_environment() -> dict[str, str]:
    module = getattr(settings, "SETTINGS_MODULE", None) or os.environ.get("DJANGO_SETTINGS_MODULE")
    if not module:
        raise ChildUnavailable(
            "settings were configured in code (no DJANGO_SETTINGS_MODULE), so no child process "
            "can load them"
        )
    paths = [path or os.getcwd() for path in sys.path]
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join(paths),
    }
