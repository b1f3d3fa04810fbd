"""How docs/quickstart.md (and every how-to after it, ``tests/project/test_howtos.py``) is followed
literally: in a fresh virtual environment, from ``pip install`` to the outbox relay, running the
page's own code blocks.

Each block the test runs is marked in the page by an HTML comment just above it, with at most a
blank line between them (invisible in the rendered docs):

``<!-- quickstart: run -->``                 run the shell block (``expect="..."``: in its output;
                                              with ``log=NAME``: wait for it in process NAME's)
``<!-- quickstart: write <path> -->``        write the block to the file
``<!-- quickstart: append <path> -->``       append the block to the file
``<!-- quickstart: serve -->``               start the block's server and wait until it answers;
                                              it is started again after later steps that write
                                              files, as runserver's autoreloader would (once
                                              per run of such steps, before the next step)
``<!-- quickstart: start NAME ready="..." -->``  start the block's command in the background as
                                              NAME (stopping the one of that name first, as
                                              Ctrl-C would) and wait for ``ready`` in its output
``<!-- quickstart: request status=N [replay=true|false] -->``  run the block's ``curl -si`` and
                                              check the status and ``Idempotent-Replay``

The how-to guides are followed the same way, after this page and in the same project, with the
marker word ``howto`` (``tests/project/test_howtos.py``). A shell block's output is its stdout and
stderr together, as a terminal shows them.

Only two things change on the way: the checkout's path for ``/path/to/django-idempotency`` and a
free port for ``127.0.0.1:8000`` (a page's test may name more, see ``Reader.replacements``); and
``runserver`` gets ``--noreload`` (nothing here edits files while it runs). A fresh virtual
environment rather than this test run's interpreter, so that the page is followed as a new user
follows it: with only the ``drf`` extra installed (no Celery, no drf-spectacular), from
``startproject``'s own settings; it costs a few seconds of ``pip install`` from the package index.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.demo.stack import stop
from tests.support.ports import free_port
from tests.support.slow import ROOT, fresh_venv, once_per_run, run, venv_environment

pytestmark = once_per_run

PAGE = ROOT / "docs" / "quickstart.md"
BLOCK = (
    r"^(?P<indent>[ \t]*)<!-- {word}: (?P<marker>[^>]*?) -->\n\n?"
    r"(?P=indent)```[^\n]*\n(?P<body>.*?)\n(?P=indent)```[ \t]*$"
)
PLACEHOLDER_CHECKOUT = "/path/to/django-idempotency"
PLACEHOLDER_ADDRESS = "127.0.0.1:8000"


@dataclass(frozen=True)
class Step:
    action: str
    arguments: list[str]
    options: dict[str, str]
    body: str

    def __str__(self) -> str:
        return f"quickstart: {self.action} {' '.join(self.arguments)}\n{self.body}"


def steps(page: str, word: str = "quickstart") -> list[Step]:
    """The code blocks of the page marked ``<!-- word: ... -->``, in order, dedented."""
    found = []
    for match in re.finditer(BLOCK.format(word=word), page, flags=re.MULTILINE | re.DOTALL):
        action, *rest = shlex.split(match["marker"])
        options = dict(word.split("=", 1) for word in rest if "=" in word)
        arguments = [word for word in rest if "=" not in word]
        lines = match["body"].splitlines()
        body = "\n".join(line.removeprefix(match["indent"]) for line in lines)
        found.append(Step(action, arguments, options, body))
    return found


@dataclass
class Reader:
    """A user at a shell: a working directory that ``cd`` moves, and the venv activated."""

    cwd: Path
    env: dict[str, str]
    port: int
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: The command of the last ``serve`` step and where it ran, to start it again after a file
    #: changed.
    serving: tuple[str, Path] | None = None
    #: Whether a file changed since the server last started: it starts again before the next
    #: step that is not a write (see ``follow``).
    stale: bool = False
    #: Processes started by ``start`` steps, and their output files, by name.
    background: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    #: Text of the page replaced on the way, beside the checkout and the address.
    replacements: dict[str, str] = field(default_factory=dict)

    def literal(self, text: str) -> str:
        text = text.replace(PLACEHOLDER_CHECKOUT, str(ROOT)).replace(
            PLACEHOLDER_ADDRESS, f"127.0.0.1:{self.port}"
        )
        for placeholder, value in self.replacements.items():
            text = text.replace(placeholder, value)
        return text

    def shell(self, script: str) -> str:
        """Run a shell block where the reader stands; follow its ``cd``."""
        where = self.cwd / ".quickstart-cwd"
        output = run(
            [
                "bash",
                "-euo",
                "pipefail",
                "-c",
                f'exec 2>&1\n{self.literal(script)}\npwd > "{where}"',
            ],
            cwd=self.cwd,
            env=self.env,
        )
        self.cwd = Path(where.read_text().strip())
        where.unlink()
        return output

    def serve(self, command: str, where: Path | None = None) -> None:
        for running in self.servers:  # Ctrl-C, as before starting it again
            stop(running)
        self.servers.clear()
        where = where or self.cwd
        self.serving = (command, where)
        self.stale = False
        with (where / "server.log").open("ab") as log:
            server = subprocess.Popen(
                ["bash", "-c", f"exec {self.literal(command)} --noreload"],
                cwd=where,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.servers.append(server)
        deadline = time.monotonic() + 60
        while not self.answers():
            assert server.poll() is None, (where / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "runserver did not answer within 60 s"
            time.sleep(0.2)

    def start(self, name: str, command: str, ready: str) -> None:
        """Run ``command`` in the background as ``name``, once ``ready`` is in its output."""
        if name in self.background:
            stop(self.background.pop(name))
        log_path = self.cwd / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {self.literal(command)}"],
                cwd=self.cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.background[name], self.logs[name] = process, log_path
        self.wait_for_output(name, ready)

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def wait_for_output(self, name: str, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output(name):
            process = self.background[name]
            assert process.poll() is None, f"{name} exited:\n{self.output(name)[-3000:]}"
            assert time.monotonic() < deadline, (
                f"{name} did not print {text!r} within {timeout} s:\n{self.output(name)[-3000:]}"
            )
            time.sleep(0.2)

    def answers(self) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request("GET", "/")
            connection.getresponse().read()
            return True
        except OSError:
            return False
        finally:
            connection.close()


def parse_curl(output: str) -> tuple[int, dict[str, str], str]:
    """Status, headers (lower-case names) and body of ``curl -si``'s output."""
    head, _, body = output.replace("\r\n", "\n").partition("\n\n")
    status_line, *header_lines = head.splitlines()
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


@contextlib.contextmanager
def reader_in(workdir: Path) -> Iterator[Reader]:
    bin_dir = fresh_venv(workdir / "venv")
    project = workdir / "work"
    project.mkdir()
    reader = Reader(project, venv_environment(bin_dir), free_port())
    try:
        yield reader
    finally:
        for server in [*reader.servers, *reader.background.values()]:
            stop(server)


def follow(page_steps: list[Step], reader: Reader, page: Path) -> None:
    """Do what each marked block says, in order, as the reader.

    After a write the server starts again (runserver's autoreloader would) before the next step
    that is not a write, not after each write: the reader meets the server only through later
    steps, and the autoreloader, which survives a half-edited project, serves them the code of
    the last write. Each restart costs a Django start-up, and the how-tos write most of their
    files two to four at a time (half the restarts)."""
    for step in page_steps:
        if step.action not in ("write", "append", "serve") and reader.stale:
            assert reader.serving is not None
            reader.serve(*reader.serving)
        if step.action == "run":
            output = reader.shell(step.body)
            if "expect" in step.options and "log" in step.options:
                reader.wait_for_output(step.options["log"], step.options["expect"])
            elif "expect" in step.options:
                assert step.options["expect"] in output, f"{step}\n--- output:\n{output}"
        elif step.action in ("write", "append"):
            (path,) = step.arguments
            target = reader.cwd / path
            assert target.parent.is_dir(), f"{step}: {target.parent} does not exist"
            mode = "a" if step.action == "append" else "w"
            with target.open(mode) as file:
                file.write(("\n" if mode == "a" else "") + reader.literal(step.body) + "\n")
            if reader.serving is not None:  # runserver's autoreloader would restart it
                reader.stale = True
        elif step.action == "serve":
            reader.serve(step.body)
        elif step.action == "start":
            (name,) = step.arguments
            reader.start(name, step.body, step.options["ready"])
        elif step.action == "request":
            status, headers, body = parse_curl(reader.shell(step.body))
            expected = int(step.options["status"])
            assert status == expected, f"{step}\n--- answer:\n{body[:2000]}"
            if "replay" in step.options:
                assert headers.get("idempotent-replay") == step.options["replay"], step
        else:
            pytest.fail(f"unknown step {step.action!r} in {page}")
    if reader.stale:  # the page ends with a write: it still has to serve
        assert reader.serving is not None
        reader.serve(*reader.serving)


def test_the_page_marks_every_step_the_test_needs() -> None:
    actions = [step.action for step in steps(PAGE.read_text())]
    assert actions.count("serve") == 1
    assert actions.count("request") >= 2
    assert {"run", "append", "write"} <= set(actions)
    assert set(actions) <= {"run", "append", "write", "serve", "request"}
