"""The demo's settings as the chaos run deploys them: relays are processes of their own.

``make demo`` relays from the web workers (a kick after each commit, a beat thread in each
worker). The chaos run turns the kick off, so that relaying happens in ``outbox_relay --loop``
processes only (woken by NOTIFY, polling as a fallback): a relay it kills is the one relaying,
and a web worker it kills was only serving a request. Everything else (database, Redis, leases,
the in-process ledger consumer) is the demo's, set through its environment variables. Log lines
carry their time, so that a run's logs can be read beside its timeline.
"""

from demo_project.settings import *  # noqa: F403
from demo_project.settings import IDEMPOTENCY, LOGGING

IDEMPOTENCY = {**IDEMPOTENCY, "OUTBOX_KICK": None}

LOGGING = {
    **LOGGING,
    "formatters": {"timed": {"format": "%(asctime)s %(process)d %(levelname)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "timed"}},
}
