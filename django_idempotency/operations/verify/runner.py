"""Run every check in order, quietly, on a run's scratch data, and clean up after them.

The configuration checks come first: when one fails, the others are reported as not run
instead of failing for a reason that is not theirs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from django_idempotency.operations.verify.answers import DuplicateRequests
from django_idempotency.operations.verify.configuration import configured
from django_idempotency.operations.verify.outbox import killed_relay
from django_idempotency.operations.verify.redis_outage import redis_outage
from django_idempotency.operations.verify.results import (
    APP_LABEL,
    Report,
    Result,
    VerifyOptions,
    guarded,
)
from django_idempotency.operations.verify.scratch import Scratch, clean_up
from django_idempotency.operations.verify.takeover import killed_request
from django_idempotency.operations.verify.transactions import atomic_requests_and_routers

__all__ = ["PLAN", "verify"]

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


def verify(options: VerifyOptions | None = None) -> Report:
    """Run every check; the report says which passed, with the evidence."""
    options = options or VerifyOptions()
    scratch = Scratch()
    report = Report(run=scratch.run)
    can_run = configured(report, scratch)
    duplicates = DuplicateRequests(scratch, options)
    checks: list[tuple[str, Callable[[], Result]]] = [
        ("concurrent duplicates run once", duplicates.concurrent),
        ("fingerprint mismatch is 422", duplicates.mismatch),
        ("replay is byte-identical, no Set-Cookie", duplicates.replay),
        ("killed request taken over, runs once", lambda: killed_request(scratch, options)),
        ("ATOMIC_REQUESTS and routers honoured", lambda: atomic_requests_and_routers(scratch)),
        ("outbox survives a killed relay", lambda: killed_relay(scratch, options)),
        ("Redis copy survives an outage", lambda: redis_outage(scratch)),
    ]
    if not can_run:
        for name, _ in checks:
            report.results.append(Result(name, None, "not run: fix the configuration first"))
        return report
    try:
        with _scenarios_quiet():
            for name, check in checks:
                report.results.append(guarded(name, check))
    finally:
        clean_up(scratch)
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
