"""Fault injection for the tour: ``X-Demo-Fault: slow=2.5`` or ``X-Demo-Fault: crash``.

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
MAX_SLOW_SECONDS = 30.0
DEFAULT_SLOW_SECONDS = 3.0


@dataclass(frozen=True)
class Fault:
    kind: str  # "slow" or "crash"
    seconds: float = 0.0

    def strike(self) -> None:
        """Called after the money moved, inside the payment's transaction."""
        if self.kind == "slow":
            time.sleep(self.seconds)
            return
        # Die the way the kernel's OOM killer would end the process: no cleanup, no response,
        # the open transaction never commits.
        os.kill(os.getpid(), signal.SIGKILL)


def from_request(request: Any) -> Fault | None:
    """The fault the request asks for; a malformed header is a 400 before any work is done."""
    raw = request.headers.get(HEADER)
    if raw is None or not settings.DEMO_FAULTS:
        return None
    value = raw.strip().lower()
    if value == "crash":
        return Fault("crash")
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
        {HEADER: [f"Use 'crash', 'slow' or 'slow=<seconds>' (up to {MAX_SLOW_SECONDS:g})."]}
    )
