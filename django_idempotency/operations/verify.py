"""``manage.py idempotency_verify``: prove the guarantees on the project's own stack.

Everything runs against the project's settings and databases, on scratch data of its own: keys
in a scratch scope (``idempotency-verify:<run>``), processed-message markers under a scratch
consumer name (the "effects" the checks count), outbox events on a scratch topic. Nothing else
is read or written, and everything is deleted at the end (and, at the next run, whatever an
interrupted run left behind for more than an hour).

Each check returns a :class:`Result` with the evidence it saw. A project that cannot run them
(the app's migrations missing, a database that refuses writes, a bad setting) gets
configuration results saying so, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections, router, transaction
from django.db.migrations.loader import MigrationLoader
from django.db.models import Model, Q
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.db import database_now, session_locks
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.outbox.publish import publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.publishers.memory import broker
from django_idempotency.publishers.routing import Route, build, resolve_route
from django_idempotency.request import redis_copy
from django_idempotency.request.lifecycle import Options, serve

__all__ = [
    "PLAN",
    "PREFIX",
    "HaltingPublisher",
    "Report",
    "Result",
    "VerifyOptions",
    "child",
    "verify",
]

logger = logging.getLogger(__name__)

#: Every scratch scope, consumer, key and topic starts with this.
PREFIX = "idempotency-verify"
APP_LABEL = "django_idempotency"
_PATH = "/idempotency-verify/"
#: How long the first of the concurrent duplicates holds its lease open for the others.
_HOLD_SECONDS = 2.0
#: Leftovers of an interrupted run older than this are swept at the next run.
_LEFTOVER_AGE = timedelta(hours=1)
_OUTAGE_ALIAS = "idempotency_verify_outage"
_EVENTS = 3

#: Every check, and what it writes (all of it scratch, deleted at the end).
PLAN: tuple[tuple[str, str], ...] = (
    ("system checks (django_idempotency)", "nothing: runs the app's system checks"),
    ("databases: migrated, writable", "one marker per database, rolled back"),
    ("Redis copy configuration", "nothing: PING"),
    ("concurrent duplicates run once", "a key and a marker (the effect)"),
    ("fingerprint mismatch is 422", "a key and a marker"),
    ("replay is byte-identical, no Set-Cookie", "nothing more"),
    ("killed request taken over, runs once", "a key and a marker; kills a child process"),
    ("ATOMIC_REQUESTS and routers honoured", "two keys and a marker (one rolled back)"),
    ("outbox survives a killed relay", "4 outbox events on a scratch topic; kills a child relay"),
    ("Redis copy survives an outage", "two keys, their Redis copies and two markers"),
)


@dataclass(frozen=True, slots=True)
class Result:
    """One row of the table: ``passed`` is None when the check did not apply (or could not run
    because the configuration failed)."""

    name: str
    passed: bool | None
    evidence: str


@dataclass(slots=True)
class Report:
    run: str
    results: list[Result] = field(default_factory=list)

    @property
    def failed(self) -> list[Result]:
        return [result for result in self.results if result.passed is False]

    @property
    def ok(self) -> bool:
        return not self.failed

    def table(self, width: int = 100) -> str:
        name_width = max(len(result.name) for result in self.results) + 2
        label = {True: "PASS", False: "FAIL", None: "SKIP"}
        lines = [f"{'CHECK':<{name_width}}RESULT  EVIDENCE"]
        evidence_width = max(width - name_width - 8, 30)
        for result in self.results:
            wrapped = textwrap.wrap(result.evidence, evidence_width) or [""]
            lines.append(f"{result.name:<{name_width}}{label[result.passed]:<8}{wrapped[0]}")
            lines.extend(" " * (name_width + 8) + line for line in wrapped[1:])
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    #: A deployment's endpoint, safe to call, for the HTTP checks (else: in this process).
    url: str | None = None
    url_headers: dict[str, str] = field(default_factory=dict)
    url_body: bytes = b'{"idempotency_verify": true}'
    #: Publish the outbox check's scratch events through the route configured for this topic
    #: (a real broker) instead of the in-memory publisher.
    outbox_topic: str | None = None
    #: The lease of the request and of the relay that the checks kill, in seconds.
    lease_seconds: float = 2.0
    concurrency: int = 6
    timeout: float = 30.0


class _ConfigurationProblem(Exception):
    """The project cannot run the checks; the message says what to fix."""


class _Scratch:
    """This run's names, and the bookkeeping to delete everything it wrote."""

    def __init__(self) -> None:
        self.run = uuid.uuid4().hex[:12]
        self.scope = f"{PREFIX}:{self.run}"
        self.topic = f"{PREFIX}.{self.run}"
        self.event_ids: set[int] = set()
        #: The first answers of the concurrency check, which the replay check compares with.
        self.first_answers: dict[str, _Answer] = {}

    def key(self, name: str) -> str:
        return f"{PREFIX}-{self.run}-{name}"

    def effects(self, name: str) -> int:
        """Scratch markers the views wrote for ``name``: how many times a view really ran."""
        return (
            ProcessedMessage.objects.using(router.db_for_write(ProcessedMessage))
            .filter(consumer=self.scope, message_id__startswith=f"{name}:")
            .count()
        )

    def effect(self, name: str) -> None:
        """What a scratch view does: one row, written in the view's transaction."""
        ProcessedMessage.objects.using(router.db_for_write(ProcessedMessage)).create(
            consumer=self.scope, message_id=f"{name}:{uuid.uuid4()}", processed_at=timezone.now()
        )


# --- entry point --------------------------------------------------------------------------------


def verify(options: VerifyOptions | None = None) -> Report:
    """Run every check; the report says which passed, with the evidence."""
    options = options or VerifyOptions()
    scratch = _Scratch()
    report = Report(run=scratch.run)
    configured = _configuration(report, scratch)
    checks: list[tuple[str, Callable[[], Result]]] = [
        ("concurrent duplicates run once", lambda: _concurrent(scratch, options)),
        ("fingerprint mismatch is 422", lambda: _mismatch(scratch, options)),
        ("replay is byte-identical, no Set-Cookie", lambda: _replay(scratch, options)),
        ("killed request taken over, runs once", lambda: _killed_request(scratch, options)),
        ("ATOMIC_REQUESTS and routers honoured", lambda: _transactions(scratch)),
        ("outbox survives a killed relay", lambda: _killed_relay(scratch, options)),
        ("Redis copy survives an outage", lambda: _redis_outage(scratch)),
    ]
    if not configured:
        for name, _ in checks:
            report.results.append(Result(name, None, "not run: fix the configuration first"))
        return report
    try:
        with _scenarios_quiet():
            for name, check in checks:
                report.results.append(_guarded(name, check))
    finally:
        _clean_up(scratch)
    return report


class _OwnLines(logging.Filter):
    """Drops the app's own log lines below ERROR: the checks provoke conflicts, takeovers and
    outages on purpose, and their table reports them; a log line for each would only print
    bare text around it ("idempotency conflict", eighteen times)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.name.startswith(APP_LABEL)


@contextlib.contextmanager
def _scenarios_quiet() -> Iterator[None]:
    """:class:`_OwnLines` on every handler while the checks run. On the handlers,
    not the loggers: a logger's filter sees only what is logged on it, not its children's."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger(), *manager.loggerDict.values()]
    handlers = {
        handler
        for found in loggers
        if isinstance(found, logging.Logger)
        for handler in found.handlers
    }
    if logging.lastResort is not None:  # what prints a WARNING when no handler is configured
        handlers.add(logging.lastResort)
    quiet = _OwnLines()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


def _guarded(name: str, check: Callable[[], Result]) -> Result:
    """A check that raises fails with the error's type and message, not a traceback."""
    try:
        return check()
    except Exception as exc:
        logger.debug("idempotency_verify: %s raised", name, exc_info=True)
        return Result(name, False, f"unexpected error: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"[:300] if first_line else type(exc).__name__


# --- configuration ------------------------------------------------------------------------------


def _aliases() -> dict[str, list[type[Model]]]:
    """Each database the app's models are routed to, with those models."""
    found: dict[str, list[type[Model]]] = {}
    for model in (IdempotencyRecord, OutboxEvent, ProcessedMessage):
        found.setdefault(router.db_for_write(model), []).append(model)
    return found


def _configuration(report: Report, scratch: _Scratch) -> bool:
    checks = _system_checks()
    report.results.append(checks)
    databases = _guarded("databases: migrated, writable", lambda: _databases(scratch))
    report.results.append(databases)
    cache_result, blocking = _cache_alias()
    report.results.append(cache_result)
    return checks.passed is not False and databases.passed is not False and not blocking


def _system_checks() -> Result:
    from django.core.checks import ERROR, run_checks

    name = "system checks (django_idempotency)"
    try:
        messages = [
            message
            for message in run_checks(include_deployment_checks=False)
            if str(message.id or "").startswith(f"{APP_LABEL}.")
        ]
    except Exception as exc:
        return Result(name, False, f"the checks could not run: {_describe(exc)}")
    errors = [message for message in messages if message.level >= ERROR]
    warnings = sorted(
        {str(message.id).rpartition(".")[2] for message in messages}
        - {str(message.id).rpartition(".")[2] for message in errors}
    )
    if errors:
        described = "; ".join(f"{message.id}: {message.msg}" for message in errors)
        return Result(name, False, f"{described} (see manage.py check)")
    return Result(
        name, True, f"no errors; warnings: {', '.join(warnings)}" if warnings else "none raised"
    )


def _databases(scratch: _Scratch) -> Result:
    name = "databases: migrated, writable"
    problems: list[str] = []
    seen: list[str] = []
    for alias, models in _aliases().items():
        connection = connections[alias]
        label = f"{alias!r} ({connection.vendor})"
        try:
            connection.ensure_connection()
        except Exception as exc:
            problems.append(f"database {label} is unreachable: {_describe(exc)}")
            continue
        missing = _unapplied(alias)
        if missing:
            problems.append(
                f"database {label} lacks {len(missing)} migration(s) of {APP_LABEL} "
                f"({', '.join(missing)}): run `manage.py migrate {APP_LABEL} --database {alias}`"
            )
            continue
        for model in models:
            try:
                _write_probe(model, alias, scratch)
            except DatabaseError as exc:
                problems.append(f"database {label} refuses writes: {_describe(exc)}")
                break
        else:
            names = ", ".join(model.__name__ for model in models)
            seen.append(f"{label}: {names}")
    if problems:
        return Result(name, False, "; ".join(problems))
    return Result(name, True, "migrated and writable: " + "; ".join(seen))


def _unapplied(alias: str) -> list[str]:
    loader = MigrationLoader(connections[alias], ignore_no_migrations=True)
    leaves = loader.graph.leaf_nodes(APP_LABEL)
    plan = [node for leaf in leaves for node in loader.graph.forwards_plan(leaf)]
    return sorted(
        {
            name
            for app, name in plan
            if app == APP_LABEL and (app, name) not in loader.applied_migrations
        }
    )


def _write_probe(model: type[Model], alias: str, scratch: _Scratch) -> None:
    """Insert a scratch row and roll it back: a read-only database refuses here."""
    now = timezone.now()
    row: Model
    if model is ProcessedMessage:
        row = ProcessedMessage(consumer=scratch.scope, message_id="write-probe", processed_at=now)
    elif model is OutboxEvent:
        row = OutboxEvent(
            topic=f"{scratch.topic}.probe", payload={}, created_at=now, next_attempt_at=now
        )
    else:
        row = IdempotencyRecord(
            scope=scratch.scope,
            key=scratch.key("write-probe"),
            fingerprint="",
            owner_token=uuid.uuid4(),
            method="POST",
            path=_PATH,
            created_at=now,
            expires_at=now,
        )
    with transaction.atomic(using=alias):
        row.save(using=alias)
        transaction.set_rollback(True, using=alias)


def _cache_alias() -> tuple[Result, bool]:
    """The Redis copy's cache, and whether its problem stops every request (a Redis that does
    not answer does not: requests fall back to the database)."""
    name = "Redis copy configuration"
    alias = conf.CACHE_ALIAS
    if alias is None:
        return Result(name, None, "CACHE_ALIAS is None: the database answers every request"), False
    caches = getattr(settings, "CACHES", {})
    if alias not in caches:
        known = ", ".join(map(repr, caches)) or "none"
        problem = f"IDEMPOTENCY['CACHE_ALIAS'] = {alias!r} is not an alias in CACHES ({known})"
        return Result(name, False, f"{problem}: name one, or set it to None"), True
    try:
        from django_redis import get_redis_connection
    except ImportError:
        return Result(name, False, "django-redis is not installed: pip install django-redis"), True
    try:
        get_redis_connection(alias).ping()
    except NotImplementedError:
        return Result(name, False, f"CACHES[{alias!r}] is not a django-redis cache"), True
    except Exception as exc:
        problem = f"Redis at CACHES[{alias!r}] does not answer: {_describe(exc)}"
        return Result(name, False, problem), False
    return Result(name, True, f"CACHES[{alias!r}] answers PING"), False


# --- requests, in this process or against --url ------------------------------------------------


@dataclass(slots=True)
class _Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get(conf.REPLAY_HEADER.lower()) == "true"

    @property
    def ran(self) -> bool:
        return self.headers.get(conf.REPLAY_HEADER.lower()) == "false"


def _answer(response: HttpResponseBase) -> _Answer:
    body = response.content if isinstance(response, HttpResponse) else b""
    headers = {name.lower(): value for name, value in response.items()}
    if getattr(response, "cookies", None):
        headers["set-cookie"] = response.cookies.output(header="").strip()
    return _Answer(response.status_code, headers, body)


class _Requests:
    """Sends scratch requests through the lifecycle (or to ``--url``) and keeps the answers."""

    def __init__(self, scratch: _Scratch, options: VerifyOptions) -> None:
        self.scratch = scratch
        self.options = options
        self.factory = RequestFactory()

    def request(self, key: str, body: bytes) -> HttpRequest:
        return self.factory.post(
            _PATH, data=body, content_type="application/json", headers={conf.HEADER: key}
        )

    def send(self, key: str, body: bytes, view: Callable[[], HttpResponseBase]) -> _Answer:
        if self.options.url:
            return self._http(key, body)
        response = serve(self.request(key, body), view, Options(), scope=lambda: self.scratch.scope)
        return _answer(response)

    def _http(self, key: str, body: bytes) -> _Answer:
        assert self.options.url is not None
        request = urllib.request.Request(
            self.options.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                **self.options.url_headers,
                conf.HEADER: key,
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout) as response:
                return _Answer(
                    response.status,
                    {name.lower(): value for name, value in response.headers.items()},
                    response.read(),
                )
        except urllib.error.HTTPError as error:
            return _Answer(
                error.code,
                {name.lower(): value for name, value in error.headers.items()},
                error.read(),
            )


def _view(
    scratch: _Scratch, name: str, hold: threading.Event | None = None
) -> Callable[[], HttpResponseBase]:
    """A scratch view: one effect row, a cookie that must never be replayed, a JSON body."""

    def view() -> HttpResponseBase:
        scratch.effect(name)
        if hold is not None:
            hold.wait(_HOLD_SECONDS)
        response = JsonResponse({"run": scratch.run, "check": name, "at": time.time()}, status=201)
        response.set_cookie(f"{PREFIX}-session", scratch.run)
        return response

    return view


def _concurrent(scratch: _Scratch, options: VerifyOptions) -> Result:
    name = "concurrent duplicates run once"
    requests = _Requests(scratch, options)
    key, count = scratch.key("concurrent"), options.concurrency
    barrier = threading.Barrier(count)
    everyone_answered = threading.Event()
    answers: list[_Answer | BaseException] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            barrier.wait(options.timeout)
            answer: _Answer | BaseException = requests.send(
                key, options.url_body, _view(scratch, "concurrent", hold=everyone_answered)
            )
        except Exception as exc:
            answer = exc
        finally:
            connections.close_all()  # this thread's connections only
        with lock:
            answers.append(answer)
            if len(answers) >= count - 1:
                everyone_answered.set()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(options.timeout + _HOLD_SECONDS + 30)
    errors = [answer for answer in answers if isinstance(answer, BaseException)]
    replies = [answer for answer in answers if isinstance(answer, _Answer)]
    ran = [answer for answer in replies if answer.ran]
    if ran:
        scratch.first_answers[key] = ran[0]
    tally = _tally(replies)
    evidence = f"{count} requests with one key at once: {tally}"
    if errors:
        evidence += f"; {len(errors)} raised: {_describe(errors[0])}"
    effects = None if options.url else scratch.effects("concurrent")
    if effects is not None:
        evidence += f"; effects committed: {effects}"
    accepted = all(
        answer.ran or answer.replayed or answer.status in (409, 503) for answer in replies
    )
    passed = len(ran) == 1 and not errors and accepted and effects in (None, 1)
    return Result(name, passed, evidence)


def _tally(answers: Sequence[_Answer]) -> str:
    counts: dict[str, int] = {}
    for answer in answers:
        if answer.ran:
            label = f"ran ({answer.status})"
        elif answer.replayed:
            label = f"replayed ({answer.status})"
        else:
            label = f"answered {answer.status}"
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{number} {label}" for label, number in sorted(counts.items()))


def _mismatch(scratch: _Scratch, options: VerifyOptions) -> Result:
    name = "fingerprint mismatch is 422"
    requests = _Requests(scratch, options)
    key = scratch.key("mismatch")
    first = requests.send(key, options.url_body, _view(scratch, "mismatch"))
    other_body = json.dumps({"idempotency_verify": "a different request", "run": scratch.run})
    second = requests.send(key, other_body.encode(), _view(scratch, "mismatch"))
    code = _error_code(second)
    evidence = f"first request {first.status}; same key, different body: {second.status}" + (
        f" {code}" if code else ""
    )
    if not options.url:
        evidence += f"; effects committed: {scratch.effects('mismatch')}"
    once = bool(options.url) or scratch.effects("mismatch") == 1
    return Result(
        name, first.ran and second.status == 422 and code == "payload_mismatch" and once, evidence
    )


def _error_code(answer: _Answer) -> str | None:
    try:
        body = json.loads(answer.body)
    except ValueError:
        return None
    return str(body.get("error")) if isinstance(body, dict) and body.get("error") else None


def _replay(scratch: _Scratch, options: VerifyOptions) -> Result:
    name = "replay is byte-identical, no Set-Cookie"
    requests = _Requests(scratch, options)
    key = scratch.key("concurrent")
    first = scratch.first_answers.pop(key, None)
    if first is None:
        key = scratch.key("replay")
        first = requests.send(key, options.url_body, _view(scratch, "replay"))
    retry = requests.send(key, options.url_body, _view(scratch, "replay"))
    same_body = retry.body == first.body
    cookie = retry.headers.get("set-cookie")
    evidence = (
        f"first {first.status} ({len(first.body)} bytes"
        + (", set a cookie" if first.headers.get("set-cookie") else "")
        + f"), retry {retry.status} replayed={retry.replayed}: body "
        + ("identical" if same_body else "DIFFERENT")
        + (f"; Set-Cookie on the replay: {cookie[:80]}" if cookie else ", no Set-Cookie")
    )
    passed = retry.replayed and retry.status == first.status and same_body and not cookie
    return Result(name, passed, evidence)


# --- a request killed mid-view ------------------------------------------------------------------


def _child_command(mode: str, arguments: dict[str, Any]) -> list[str]:
    script = (
        "import sys, django; django.setup(); "
        "from django_idempotency.operations.verify import child; child(sys.argv[1], sys.argv[2])"
    )
    return [sys.executable, "-c", script, mode, json.dumps(arguments)]


def _child_environment() -> dict[str, str]:
    module = getattr(settings, "SETTINGS_MODULE", None) or os.environ.get("DJANGO_SETTINGS_MODULE")
    if not module:
        raise _ConfigurationProblem(
            "settings were configured in code (no DJANGO_SETTINGS_MODULE), so no child process "
            "can load them"
        )
    paths = [path or os.getcwd() for path in sys.path]
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join(paths),
    }


@contextlib.contextmanager
def _spawned(mode: str, arguments: dict[str, Any]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        _child_command(mode, arguments),
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


def _await_line(process: subprocess.Popen[bytes], prefix: str, timeout: float) -> str:
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


def _killed_request(scratch: _Scratch, options: VerifyOptions) -> Result:
    name = "killed request taken over, runs once"
    key = scratch.key("killed")
    arguments = {
        "scope": scratch.scope,
        "key": key,
        "body": options.url_body.decode(),
        "lease": options.lease_seconds,
    }
    try:
        with _spawned("request", arguments) as child_process:
            _await_line(child_process, "IN-VIEW", options.timeout)
            os.killpg(child_process.pid, signal.SIGKILL)
            child_process.wait(30)
            pid = child_process.pid
    except _ConfigurationProblem as problem:
        return Result(name, None, f"not run: {problem}")
    requests = _Requests(scratch, VerifyOptions(url_body=options.url_body))
    view = _view(scratch, "killed")
    answers: list[_Answer] = []
    deadline = time.monotonic() + options.lease_seconds + options.timeout
    while time.monotonic() < deadline:
        answer = requests.send(key, options.url_body, view)
        answers.append(answer)
        if answer.status != 409:
            break
        time.sleep(0.2)
    conflicts = [answer for answer in answers if answer.status == 409]
    final = answers[-1]
    record = IdempotencyRecord.objects.using(router.db_for_write(IdempotencyRecord)).filter(
        scope=scratch.scope, key=key
    )
    attempts = record.values_list("attempts", flat=True).first()
    effects = scratch.effects("killed")
    evidence = (
        f"child pid {pid} claimed the key (lease {options.lease_seconds:g} s), wrote its effect "
        f"and was killed (SIGKILL) mid-view; "
        + (
            f"{len(conflicts)} retries during the lease answered 409 (Retry-After "
            f"{conflicts[0].headers.get('retry-after', '?')}); "
            if conflicts
            else "the first retry took the key over at once (its owner's connection was gone); "
        )
        + f"then {final.status}, {'ran' if final.ran else 'did not run'} as attempt {attempts}; "
        f"effects committed: {effects}"
    )
    passed = final.ran and final.status == 201 and attempts == 2 and effects == 1
    return Result(name, passed, evidence)


# --- transactions and routing ------------------------------------------------------------------


def _transactions(scratch: _Scratch) -> Result:
    name = "ATOMIC_REQUESTS and routers honoured"
    requests = _Requests(scratch, VerifyOptions())
    records = router.db_for_write(IdempotencyRecord)
    key = scratch.key("atomic")
    seen: dict[str, Any] = {}

    def committed_claim() -> None:
        # Another thread, another connection: it sees only committed rows.
        try:
            seen["claim visible"] = (
                IdempotencyRecord.objects.using(records)
                .filter(scope=scratch.scope, key=key, status=IdempotencyRecord.Status.PROCESSING)
                .exists()
            )
        finally:
            connections.close_all()

    def view() -> HttpResponseBase:
        seen["atomic"] = {alias: connections[alias].in_atomic_block for alias in connections}
        reader = threading.Thread(target=committed_claim)
        reader.start()
        reader.join(30)
        return _view(scratch, "atomic")()

    requests.send(key, b"{}", view)
    wanted = {records} | {
        alias
        for alias, settings_dict in connections.settings.items()
        if settings_dict.get("ATOMIC_REQUESTS")
    }
    atomic = seen.get("atomic", {})
    outside = sorted(alias for alias in wanted if not atomic.get(alias))
    stored = IdempotencyRecord.objects.using(records).filter(scope=scratch.scope, key=key)

    failing_key = scratch.key("atomic-raises")

    def failing_view() -> HttpResponseBase:
        scratch.effect("atomic-raises")
        raise RuntimeError("the view failed after writing")

    with contextlib.suppress(RuntimeError):
        requests.send(failing_key, b"{}", failing_view)
    left = IdempotencyRecord.objects.using(records).filter(scope=scratch.scope, key=failing_key)
    rolled_back = scratch.effects("atomic-raises") == 0 and not left.exists()

    routes = ", ".join(
        f"{model.__name__} -> {router.db_for_write(model)!r}"
        for model in (IdempotencyRecord, OutboxEvent, ProcessedMessage)
    )
    inside = ", ".join(sorted(alias for alias, within in atomic.items() if within)) or "none"
    claim = "yes" if seen.get("claim visible") else "NO"
    failure = "no effect and released its key" if rolled_back else "ITS EFFECT OR KEY BEHIND"
    evidence = (
        f"routers: {routes}; the record was written to {records!r}: "
        f"{'yes' if stored.exists() else 'NO'}; the view ran inside transactions on {inside}"
        + (f" (NOT on {', '.join(outside)})" if outside else "")
        + f"; the claim was committed before the view: {claim}"
        + f"; a view that raised left {failure}"
    )
    passed = stored.exists() and not outside and bool(seen.get("claim visible")) and rolled_back
    return Result(name, passed, evidence)


# --- the outbox: a relay killed between publish and ack -----------------------------------------


def _scratch_relay(event_ids: Sequence[int], **kwargs: Any) -> Relay:
    """A relay that sees only this run's scratch events, never the project's own (nor the
    gate, which holds the project's relays back from them)."""
    return Relay(only=Q(pk__in=list(event_ids)), **kwargs)


class HaltingPublisher(Publisher):
    """For the relay the outbox check kills: publishes (through ``inner``, the route the child
    resolved from its own settings, or the in-memory broker), reports the ids on stdout, then
    waits to be killed before its ack."""

    def __init__(self, *, inner: Route | None = None) -> None:
        super().__init__()
        self.inner = build(inner) if inner is not None else None

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        if self.inner is not None:
            results = self.inner.publish_many(messages)
        else:
            for message in messages:
                broker.receive(message)
            results = [None] * len(messages)
        sent = [str(m.event_id) for m, error in zip(messages, results, strict=True) if not error]
        print("PUBLISHED", " ".join(sent), flush=True)
        time.sleep(3600)  # killed here: published, never acknowledged
        return results


def _killed_relay(scratch: _Scratch, options: VerifyOptions) -> Result:
    name = "outbox survives a killed relay"
    using = router.db_for_write(OutboxEvent)
    topic = options.outbox_topic or scratch.topic
    gate_topic = f"{scratch.topic}.gate"
    memory = "django_idempotency.publishers.memory.MemoryPublisher"
    user_routes = dict(conf.OUTBOX_PUBLISHERS)
    if options.outbox_topic is not None:
        resolve_route(topic, user_routes)  # unroutable: fails here, not in the child
    routes = {
        gate_topic: memory,
        **({} if options.outbox_topic else {topic: memory}),
        **user_routes,
    }
    quiet = {"OUTBOX_PUBLISHERS": routes, "OUTBOX_KICK": None, "OUTBOX_NOTIFY": False}
    with (
        override_settings(IDEMPOTENCY={**getattr(settings, "IDEMPOTENCY", {}), **quiet}),
        _gate_held(using) as gate_token,
    ):
        events = _scratch_events(scratch, topic, gate_topic, gate_token, using)
        ids = [event.pk for event in events]
        wanted = {str(event.event_id) for event in events}
        # The route's OPTIONS hold passwords and signing secrets: the child gets the topic and
        # resolves the route from its own settings, so nothing secret is on its command line.
        arguments = {
            "ids": ids,
            "topic": topic,
            "routed": options.outbox_topic is not None,
            "lease": options.lease_seconds,
        }
        try:
            with _spawned("relay", arguments) as child_process:
                first = set(_await_line(child_process, "PUBLISHED", options.timeout).split())
                os.killpg(child_process.pid, signal.SIGKILL)
                child_process.wait(30)
        except _ConfigurationProblem as problem:
            return Result(name, None, f"not run: {problem}")
        before = len(broker.snapshot())
        republished: list[str] = []
        deadline = time.monotonic() + options.lease_seconds + options.timeout
        with _scratch_relay(ids, using=using) as relay:
            while time.monotonic() < deadline:
                stats = relay.drain()
                if OutboxEvent.objects.using(using).filter(
                    pk__in=ids, status=OutboxStatus.PUBLISHED
                ).count() == len(ids):
                    break
                if not stats.claimed:
                    time.sleep(0.2)
        if options.outbox_topic is None:
            republished = [
                str(message.event_id)
                for message in broker.snapshot()[before:]
                if str(message.event_id) in wanted
            ]
        published = OutboxEvent.objects.using(using).filter(
            pk__in=ids, status=OutboxStatus.PUBLISHED
        )
        lost = len(ids) - published.count()
    if options.outbox_topic is None:
        again = len(first & set(republished))
        second = f"{len(republished)} ({again} of them again, with the same event id)"
    else:
        second = "them through the route configured for the topic"
    evidence = (
        f"{len(ids)} scratch events on {topic!r} (one key); relay A (pid {child_process.pid}, "
        f"lease {options.lease_seconds:g} s) published {len(first)} and was killed before its "
        f"ack; relay B, after that lease, published {second}; "
        f"PUBLISHED: {published.count()}, lost: {lost}"
    )
    passed = lost == 0 and bool(first) and first <= wanted
    if options.outbox_topic is None:
        passed = passed and set(republished) == wanted
    return Result(name, passed, evidence)


@contextlib.contextmanager
def _gate_held(using: str) -> Iterator[uuid.UUID]:
    """The token of the gate's lease, with its relay lock held on this connection while the
    check runs: a lease whose lock nobody holds is a gone relay's, which the project's relays
    release at once (``Relay._release_batches_of_gone_relays``), and would then publish the gate
    and take the scratch events before this run's relays."""
    token = uuid.uuid4()
    held = session_locks.enabled(using)
    if held:
        session_locks.hold_batch(using, token)
    try:
        yield token
    finally:
        if held:
            session_locks.let_go_of_batch(using, token)


def _scratch_events(
    scratch: _Scratch, topic: str, gate_topic: str, gate_token: uuid.UUID, using: str
) -> list[OutboxEvent]:
    """The scratch events, behind a gate only this run's relays can pass.

    The gate is an earlier event with the same key, leased for a day under ``gate_token`` (see
    :func:`_gate_held`): every relay of the project holds later events of a key back while an
    earlier one is leased elsewhere, so none of them ever claims these. The scratch relays see
    only the scratch events, not the gate.
    """
    key = scratch.key("outbox")
    with transaction.atomic(using=using):
        gate = publish(gate_topic, {"gate": scratch.run}, key=key, using=using)
        OutboxEvent.objects.using(using).filter(pk=gate.pk).update(
            locked_until=database_now(using) + timedelta(days=1), relay_token=gate_token
        )
        events = [
            publish(topic, {PREFIX: scratch.run, "n": n}, key=key, using=using)
            for n in range(_EVENTS)
        ]
    scratch.event_ids.update([gate.pk, *(event.pk for event in events)])
    return events


# --- Redis --------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _redis_outage(scratch: _Scratch) -> Result:
    name = "Redis copy survives an outage"
    alias = conf.CACHE_ALIAS
    if alias is None:
        return Result(name, None, "CACHE_ALIAS is None: no Redis to lose")
    from django_redis import get_redis_connection

    requests = _Requests(scratch, VerifyOptions())
    records = connections[router.db_for_write(IdempotencyRecord)]
    before, during = scratch.key("redis-before"), scratch.key("redis-during")
    first = requests.send(before, b"{}", _view(scratch, "redis-before"))
    # The database answers the first retry and copies its response to Redis.
    from_database = requests.send(before, b"{}", _view(scratch, "redis-before"))
    copied = bool(get_redis_connection(alias).exists(redis_copy.redis_key(scratch.scope, before)))
    with CaptureQueriesContext(records) as queries:
        from_redis = requests.send(before, b"{}", _view(scratch, "redis-before"))
    redis_queries = len(queries)

    failures: list[str] = []

    def count_failure(sender: Any, **kwargs: Any) -> None:
        failures.append(str(kwargs.get("operation", "")))

    caches = dict(getattr(settings, "CACHES", {}))
    original = caches[alias]
    caches[_OUTAGE_ALIAS] = {
        key: value
        for key, value in original.items()
        if key in ("KEY_PREFIX", "VERSION", "KEY_FUNCTION")
    } | {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
    }
    outage = {**getattr(settings, "IDEMPOTENCY", {}), "CACHE_ALIAS": _OUTAGE_ALIAS}
    signals.redis_copy_failed.connect(count_failure, dispatch_uid=f"{PREFIX}-{scratch.run}")
    try:
        with override_settings(CACHES=caches, IDEMPOTENCY=outage):
            replay_down = requests.send(before, b"{}", _view(scratch, "redis-before"))
            ran_down = requests.send(during, b"{}", _view(scratch, "redis-during"))
            retry_down = requests.send(during, b"{}", _view(scratch, "redis-during"))
    finally:
        signals.redis_copy_failed.disconnect(dispatch_uid=f"{PREFIX}-{scratch.run}")
    retry_up = requests.send(during, b"{}", _view(scratch, "redis-during"))
    effects = (scratch.effects("redis-before"), scratch.effects("redis-during"))
    evidence = (
        f"with Redis: ran {first.status}, replayed {from_database.status} by the database and "
        f"copied to Redis: {'yes' if copied else 'NO'}, replay "
        f"{from_redis.status} with {redis_queries} database queries; Redis unreachable "
        f"(CACHE_ALIAS pointed at a closed port, in this process only): {len(failures)} Redis "
        f"error(s) absorbed, replay {replay_down.status} "
        f"{'identical' if replay_down.body == first.body else 'DIFFERENT'}, a new key ran "
        f"{ran_down.status} and its retry replayed {retry_down.status}; Redis back: retry "
        f"{retry_up.status} replayed={retry_up.replayed}; effects committed: "
        f"{effects[0]} and {effects[1]}"
    )
    passed = (
        first.ran
        and from_database.replayed
        and copied
        and from_redis.replayed
        and redis_queries == 0
        and bool(failures)
        and replay_down.replayed
        and replay_down.body == first.body
        and ran_down.ran
        and retry_down.replayed
        and retry_up.replayed
        and effects == (1, 1)
    )
    return Result(name, passed, evidence)


# --- clean-up -----------------------------------------------------------------------------------


def _clean_up(scratch: _Scratch) -> None:
    """Delete this run's scratch rows and Redis copies, and leftovers of interrupted runs."""
    cutoff = timezone.now() - _LEFTOVER_AGE
    records = IdempotencyRecord.objects.using(router.db_for_write(IdempotencyRecord))
    mine = records.filter(scope=scratch.scope) | records.filter(
        key__startswith=f"{PREFIX}-{scratch.run}-"
    )
    old = records.filter(scope__startswith=f"{PREFIX}:", created_at__lt=cutoff)
    for queryset in (mine, old):
        for scope, key in list(queryset.values_list("scope", "key")):
            redis_copy.forget(scope, key)
        queryset.delete()
    messages = ProcessedMessage.objects.using(router.db_for_write(ProcessedMessage))
    messages.filter(consumer=scratch.scope).delete()
    messages.filter(consumer__startswith=f"{PREFIX}:", processed_at__lt=cutoff).delete()
    events = OutboxEvent.objects.using(router.db_for_write(OutboxEvent))
    events.filter(pk__in=scratch.event_ids).delete()
    events.filter(topic__startswith=f"{PREFIX}.", created_at__lt=cutoff).delete()


# --- the child processes ------------------------------------------------------------------------


def child(mode: str, raw: str) -> None:
    """Entry point of the processes the checks kill (after ``django.setup()``)."""
    arguments = json.loads(raw)
    if mode == "request":
        _child_request(arguments)
    elif mode == "relay":
        _child_relay(arguments)
    else:  # pragma: no cover - only ever called by this module
        raise SystemExit(f"unknown mode {mode!r}")


def _child_request(arguments: dict[str, Any]) -> None:
    # This process's own settings: a short lease, and no heartbeat to keep it alive.
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "LEASE_SECONDS": arguments["lease"],
        "LEASE_HEARTBEAT": False,
    }
    scratch = _Scratch()
    scratch.scope = arguments["scope"]

    def view() -> HttpResponseBase:
        scratch.effect("killed")
        print("IN-VIEW", flush=True)
        time.sleep(3600)  # killed here, inside the view's transaction
        raise AssertionError("not killed")

    request = RequestFactory().post(
        _PATH,
        data=arguments["body"].encode(),
        content_type="application/json",
        headers={conf.HEADER: arguments["key"]},
    )
    serve(request, view, Options(), scope=lambda: scratch.scope)


def _child_relay(arguments: dict[str, Any]) -> None:
    # Resolved here, from this process's settings, before they route the topic to the halting
    # publisher: the parent never passes a route's OPTIONS (see _killed_relay).
    inner = resolve_route(arguments["topic"]) if arguments["routed"] else None
    halting = {"BACKEND": f"{__name__}.HaltingPublisher", "OPTIONS": {"inner": inner}}
    halted = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "OUTBOX_PUBLISHERS": {arguments["topic"]: halting},
        "OUTBOX_KICK": None,
    }
    with (
        override_settings(IDEMPOTENCY=halted),
        _scratch_relay(arguments["ids"], lease_seconds=arguments["lease"]) as relay,
    ):
        relay.run_once()
