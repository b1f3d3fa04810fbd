"""What every check shares: its result, the report they make up, and the command's options.

A check that raises fails with the error's first line rather than a traceback: the command
prints a table, and a project that cannot run a check learns why from its row.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["APP_LABEL", "Report", "Result", "VerifyOptions", "error_summary", "guarded"]

logger = logging.getLogger(__name__)

APP_LABEL = "django_idempotency"


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


def guarded(name: str, check: Callable[[], Result]) -> Result:
    """A check that raises fails with the error's type and message, not a traceback."""
    try:
        return check()
    except Exception as exc:
        logger.debug("idempotency_verify: %s raised", name, exc_info=True)
        return Result(name, False, f"unexpected error: {error_summary(exc)}")


def error_summary(exc: BaseException) -> str:
    """The error's type and the first line of its message, for a row of the table."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"[:300] if first_line else type(exc).__name__
