"""The check that the project's routers and ``ATOMIC_REQUESTS`` are honoured.

The record lands on the database the router names, the view runs inside a transaction there and
on every ``ATOMIC_REQUESTS`` database, the claim committed before the view (another connection
sees it), and a view that raises leaves no write and releases its key.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from django.db import connections, router
from django.http import HttpResponseBase

from django_idempotency.models import IdempotencyRecord, OutboxEvent, ProcessedMessage
from django_idempotency.operations.verify.client import Requests, scratch_view
from django_idempotency.operations.verify.results import Result, VerifyOptions
from django_idempotency.operations.verify.scratch import Scratch

__all__ = ["atomic_requests_and_routers"]


def atomic_requests_and_routers(scratch: Scratch) -> Result:
    """One request that succeeds and one that raises, watched from inside their views."""
    name = "ATOMIC_REQUESTS and routers honoured"
    requests = Requests(scratch, VerifyOptions())
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
        return scratch_view(scratch, "atomic")()

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
