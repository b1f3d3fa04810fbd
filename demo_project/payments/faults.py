"""Fault injection for the tour and the tests: the ``X-Demo-Fault`` request header.

``slow`` / ``slow=<seconds>``  the payment sleeps after moving the money, inside its transaction.
``crash``                      the web process kills itself at the same point.
``crash-ledger``               the payment commits; the ledger consumer's worker process kills
                               itself in the middle of the first delivery of its event (after
                               writing the entries, before the commit). Needs a broker.

Honoured only with ``settings.DEMO_FAULTS``; otherwise the header is ignored. The header is not
part of the request fingerprint, so a retry without it is still the same request.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ValidationError

HEADER = "X-Demo-Fault"
#: The outbox event header that carries a consumer fault from the request to the worker.
EVENT_HEADER = "demo_fault"
MAX_SLOW_SECONDS = 30.0
DEFAULT_SLOW_SECONDS = 3.0


@dataclass(frozen=True)
class Fault:
    kind: str  # "slow", "crash" or "crash-ledger"
    seconds: float = 0.0

    def strike(self) -> None:
        """Called after the money moved, inside the payment's transaction."""
        if self.kind == "slow":
            time.sleep(self.seconds)
        elif self.kind == "crash":
            _die()

    @property
    def event_headers(self) -> dict[str, str]:
        """What the payment's event carries to its consumer."""
        return {EVENT_HEADER: "crash"} if self.kind == "crash-ledger" else {}


def strike_consumer(request: Any) -> None:
    """Called by the ledger consumer after writing its entries, inside its transaction.

    Only on a first delivery from a broker: the redelivery after the crash must get through,
    and in-process (no broker) the "worker" is the web process itself.
    """
    headers = getattr(request, "headers", None) or {}
    wanted = getattr(request, EVENT_HEADER, None) or headers.get(EVENT_HEADER)
    delivery = request.delivery_info or {}
    if (
        wanted == "crash"
        and settings.DEMO_FAULTS
        and not request.is_eager
        and not delivery.get("redelivered")
    ):
        _die()


def _die() -> None:
    # Die the way the kernel's OOM killer would end the process: no cleanup, no response or
    # acknowledgement, the open transaction never commits.
    os.kill(os.getpid(), signal.SIGKILL)


def from_request(request: Any) -> Fault | None:
    """The fault the request asks for; a malformed header is a 400 before any work is done."""
    raw = request.headers.get(HEADER)
    if raw is None or not settings.DEMO_FAULTS:
        return None
    value = raw.strip().lower()
    if value == "crash":
        return Fault("crash")
    if value == "crash-ledger":
        if not settings.CELERY_BROKER_URL:
            raise ValidationError(
                {HEADER: ["'crash-ledger' needs a Celery worker: set CELERY_BROKER_URL."]}
            )
        return Fault("crash-ledger")
    if value == "slow":
        return Fault("slow", DEFAULT_SLOW_SECONDS)
    if value.startswith("slow="):
        try:
            seconds = float(value.removeprefix("slow="))
        except ValueError:
            seconds = -1.0
        if 0 < seconds <= MAX_SLOW_SECONDS:
            return Fault("slow", seconds)
    raise ValidationError(
        {
            HEADER: [
                f"Use 'crash', 'crash-ledger', 'slow' or 'slow=<seconds>' "
                f"(up to {MAX_SLOW_SECONDS:g})."
            ]
        }
    )
