"""Run passes of the test suite side by side: ``make test`` runs its six (each Django series on
each database, then the reliability suite) through this, ``TEST_JOBS`` at a time.

Each pass is a make target (``test-dj52-sqlite``, ...) run as ``make <target>`` with its output
in ``artifacts/<target>.log``; a pass that ends prints the tail of its log (the slowest tests
and the summary), a pass that fails prints its whole log, and the run fails if any pass failed.
Passes start in the order given (longest first balances best) as soon as a slot is free.

Passes that run together share the machine's services, so each pass gets a database of its own:
the database named in ``POSTGRES_URL`` and ``MARIADB_URL`` gets the pass's name as a suffix
(pytest-django then creates ``test_<name>_<pass>``). Everything else the passes share is already
taken per test or per process: Redis keys under a fresh prefix per test (no test flushes a
database), RabbitMQ queues and NATS streams under fresh names, private servers on free ports,
files under pytest's temporary directories or named after the process, and coverage data in
``.coverage.<pass>`` files.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[2]
#: The service URLs whose database each pass gets its own copy of.
DATABASE_URLS = ("POSTGRES_URL", "MARIADB_URL")
#: Where a passing pass's log starts to be worth printing: pytest's ``--durations`` table.
TAIL_START = re.compile(r"^=+ slowest \d+ durations =+$")
#: Lines printed from a passing pass's log when it has no durations table.
TAIL_LINES = 40
#: How long passes get to stop (pytest runs its fixtures' teardown) when the run is cancelled.
STOP_SECONDS = 60


@dataclass
class Pass:
    target: str
    log: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    seconds: float = 0.0
    #: CPU seconds of the pass and the processes it waited for (servers, workers, builds).
    cpu: float = 0.0
    returncode: int | None = None
    stopped: bool = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.returncode is None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


def database_suffix(target: str) -> str:
    """``test-dj52-postgresql`` -> ``_dj52_postgresql``."""
    return "_" + re.sub(r"\W+", "_", target.removeprefix("test-")).strip("_")


def with_database_suffix(url: str, suffix: str) -> str:
    """The URL with ``suffix`` added to its database name."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    if not name:
        return url
    return urlunsplit(parts._replace(path=f"/{name}{suffix}"))


def environment(target: str) -> dict[str, str]:
    env = dict(os.environ)
    suffix = database_suffix(target)
    for variable in DATABASE_URLS:
        if env.get(variable):
            env[variable] = with_database_suffix(env[variable], suffix)
    return env


def cpu_of_children() -> float:
    """CPU seconds of the children reaped so far, and of the processes they reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def minutes(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def shown(path: Path) -> str:
    """The path as the reader's shell would name it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def say(text: str = "") -> None:
    print(text, flush=True)


def tail(log: Path) -> list[str]:
    """A passing pass's log from its durations table on (its skip reasons left out), or its last
    lines."""
    lines = log.read_text(errors="replace").splitlines()
    for index, line in enumerate(lines):
        if TAIL_START.match(line):
            shown: list[str] = []
            for line in lines[index:]:
                if not line.startswith("SKIPPED "):
                    shown.append(line)
                elif not shown[-1].startswith("(skip reasons"):
                    shown.append("(skip reasons: see the log)")
            return shown
    return lines[-TAIL_LINES:]


class Run:
    def __init__(self, targets: list[str], jobs: int, logs: Path, make: list[str]) -> None:
        self.passes = [Pass(target, logs / f"{target}.log") for target in targets]
        self.waiting = deque(self.passes)
        self.jobs = max(1, jobs)
        self.make = make
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, one: Pass) -> None:
        with one.log.open("wb") as output:
            one.process = subprocess.Popen(
                [*self.make, "--no-print-directory", one.target],
                cwd=ROOT,
                env=environment(one.target),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                # A group of its own, so that stopping the run stops each pass and what it
                # started, and a Ctrl-C reaches the passes only through stop().
                start_new_session=True,
            )
        one.started = time.monotonic()
        say(f"== {one.target}: started ({shown(one.log)})")

    def finish(self, one: Pass, returncode: int) -> None:
        one.returncode, one.seconds = returncode, one.elapsed
        if returncode == 0:
            say(f"== {one.target}: passed in {minutes(one.seconds)} (CPU {minutes(one.cpu)})")
            for line in tail(one.log):
                say(f"   {line}")
        else:
            say(f"== {one.target}: FAILED (exit {returncode}) in {minutes(one.seconds)}; its log:")
            say(one.log.read_text(errors="replace"))
            say(f"== {one.target}: FAILED, log above ({shown(one.log)})")
        say()

    def running(self) -> list[Pass]:
        return [one for one in self.passes if one.running]

    def loop(self, heartbeat: float) -> None:
        next_heartbeat = time.monotonic() + heartbeat
        while self.waiting or self.running():
            while self.waiting and len(self.running()) < self.jobs:
                self.start(self.waiting.popleft())
            for one in self.running():
                assert one.process is not None
                before = cpu_of_children()
                returncode = one.process.poll()
                if returncode is not None:
                    one.cpu = cpu_of_children() - before
                    self.finish(one, returncode)
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + heartbeat
                busy = ", ".join(f"{one.target} ({minutes(one.elapsed)})" for one in self.running())
                queued = ", ".join(one.target for one in self.waiting) or "nothing"
                say(f"== still running: {busy}; waiting: {queued}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGINT to every running pass's group (pytest tears its fixtures down and stops the
        servers it started), then SIGKILL to what is left after ``STOP_SECONDS``."""
        running = self.running()
        for one in running:
            assert one.process is not None
            with contextlib.suppress(ProcessLookupError):  # ended already
                os.killpg(one.process.pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_SECONDS
        for one in running:
            assert one.process is not None
            try:
                one.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # ended already
                    os.killpg(one.process.pid, signal.SIGKILL)
                one.process.wait()
            one.returncode, one.seconds, one.stopped = one.process.returncode, one.elapsed, True

    def summary(self, seconds: float) -> bool:
        """Print a line per pass; whether every pass passed."""
        say(f"== passes, {self.jobs} at a time, in {minutes(seconds)}:")
        for one in self.passes:
            if one.process is None:
                result = "not run"
            elif one.stopped:
                result = "stopped"
            else:
                result = "passed" if one.returncode == 0 else f"FAILED (exit {one.returncode})"
            say(f"   {one.target:<24} {result:<18} {minutes(one.seconds)}  CPU {minutes(one.cpu)}")
        failed = [one.target for one in self.passes if one.returncode != 0]
        if failed:
            say(f"== failed: {', '.join(failed)} (logs in {shown(self.passes[0].log.parent)})")
        return not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", help="make targets, one pass each, longest first")
    parser.add_argument("--jobs", type=int, default=2, help="passes at a time (default: 2)")
    parser.add_argument("--logs", type=Path, default=ROOT / "artifacts", help="log directory")
    parser.add_argument("--make", default="make", help="the make command (make passes $(MAKE))")
    parser.add_argument(
        "--heartbeat", type=float, default=300, help="seconds between 'still running' lines"
    )
    options = parser.parse_args(argv)
    run = Run(options.targets, options.jobs, options.logs.resolve(), options.make.split())

    def cancelled(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # SIGINT too, even where it is ignored (make run in the background of a shell): a handler,
    # unlike an ignored signal, is reset for the passes, so pytest stops on the SIGINT of stop().
    signal.signal(signal.SIGINT, cancelled)
    signal.signal(signal.SIGTERM, cancelled)
    began = time.monotonic()
    try:
        run.loop(options.heartbeat)
    except KeyboardInterrupt:
        say("== cancelled: stopping the passes that run")
        run.stop()
        run.summary(time.monotonic() - began)
        return 130
    return 0 if run.summary(time.monotonic() - began) else 1


if __name__ == "__main__":
    sys.exit(main())
