"""``manage.py idempotency_verify``: prove the guarantees on the project's own stack.

Everything runs against the project's settings and databases, on scratch data of its own: keys
in a scratch scope (``idempotency-verify:<run>``), processed-message markers under a scratch
consumer name (the "effects" the checks count), outbox events on a scratch topic. Nothing else
is read or written, and everything is deleted at the end (and, at the next run, whatever an
interrupted run left behind for more than an hour).

Each check returns a :class:`Result` with the evidence it saw. A project that cannot run them
(the app's migrations missing, a database that refuses writes, a bad setting) gets
configuration results saying so, never a traceback.

One module per group of checks (:mod:`.configuration`, :mod:`.answers`, :mod:`.takeover`,
:mod:`.transactions`, :mod:`.outbox`, :mod:`.redis_outage`), over the scratch requests
(:mod:`.client`) and the child processes the checks kill (:mod:`.harness`); :mod:`.runner` runs
them in order.
"""

from django_idempotency.operations.verify.results import Report, Result, VerifyOptions
from django_idempotency.operations.verify.runner import PLAN, verify
from django_idempotency.operations.verify.scratch import PREFIX

__all__ = ["PLAN", "PREFIX", "Report", "Result", "VerifyOptions", "verify"]
