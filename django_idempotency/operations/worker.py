"""What a Celery worker says when it loses the pool process running one of the app's tasks.

The tasks are ``acks_late`` and ``reject_on_worker_lost``: when the prefork process running one
dies (``kill -9``, the OOM killer), the worker puts the message back on the queue. Celery's own
line for it, ``Task handler raised error: WorkerLostError(...)``, names no task and does not say
what became of the message; and the message carries the expiry its beat entry gave it, so once
that has passed the broker drops it unrun, without a line anywhere. :class:`LostWorkerRequest`
(the tasks' ``Request`` class, loaded by the worker only) adds one WARNING that says both.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from celery.exceptions import WorkerLostError
from celery.worker.request import Request

__all__ = ["LostWorkerRequest"]

logger = logging.getLogger("django_idempotency.tasks")


class LostWorkerRequest(Request):  # type: ignore[misc]  # Celery is untyped
    """Celery's request, plus a log line when the task's pool process was lost."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        error = exc_info.exception
        # billiard wraps what a pool process raised (ExceptionWithTraceback, with .exc).
        error = error if isinstance(error, WorkerLostError) else getattr(error, "exc", error)
        if isinstance(error, WorkerLostError):
            logger.warning(
                "%s[%s] lost its worker process (%s): %s",
                self.name,
                self.id,
                error,
                self._what_becomes_of_it(),
                extra={"task_name": self.name, "task_id": self.id, "task_expires": self.expires},
            )

    def _what_becomes_of_it(self) -> str:
        if not (self.task.acks_late and self.task.reject_on_worker_lost):
            return "its message was acknowledged: it does not run again until the next schedule"
        expires: datetime | None = self.expires
        if expires is None:
            return "the message was requeued, and runs again"
        at = expires.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        if expires <= datetime.now(UTC):
            return (
                f"the message was requeued, but it expired at {at}: it is dropped unrun, and "
                "the next scheduled run does the work"
            )
        return (
            f"the message was requeued, and runs again if a worker takes it before it expires "
            f"at {at}; after that it is dropped unrun, and the next scheduled run does the work"
        )
