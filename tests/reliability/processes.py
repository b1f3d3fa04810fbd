"""Child processes for the fault tests and the chaos run: relays, workers, servers of our own.

No Django here, so that a runner outside pytest (``python -m tests.reliability.chaos``) can use
it before, or without, configuring settings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import IO

from tests.support.servers import ROOT


class Child:
    """A process in its own session, its output in a file the test can read; killed with its
    process group by ``close()`` however the test ends."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.log: IO[bytes] = tempfile.NamedTemporaryFile(prefix=f"rel-{name}-", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen(
            args,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole group at once: no handler runs, nothing is cleaned up."""
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM (a clean stop) and wait; SIGKILL if it does not stop in ``timeout``."""
        if self.alive():
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.process.returncode)

    def close(self) -> None:
        if self.alive():
            self.kill()
        else:  # the group may outlive its leader
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} (pid {self.pid}) output ---\n{self.output()[-chars:]}"
