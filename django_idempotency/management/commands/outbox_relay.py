"""Publish due outbox events: one pass for cron, or ``--loop`` as a long-running relay."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_idempotency.conf import conf
from django_idempotency.core.failures import describe
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.report import RelayStats, RouteFailure

#: Exit status when some events failed to publish (they are retried later, or DEAD).
EXIT_FAILURES = 3


class Command(BaseCommand):
    help = (
        "Publish due outbox events. Without --loop: until none are due, then exit (0 when all "
        f"were published, {EXIT_FAILURES} when some failed). With --loop: until SIGTERM/SIGINT, "
        "waking on NOTIFY (PostgreSQL) or every --sleep seconds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Keep relaying until stopped.")
        parser.add_argument(
            "--sleep",
            type=float,
            default=None,
            help="Seconds between polls with --loop (default: OUTBOX_POLL_SECONDS).",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            help="Events per claim (default: OUTBOX_BATCH_SIZE).",
        )
        parser.add_argument(
            "--max-batches",
            type=int,
            default=None,
            help="Stop a single pass after this many batches (default: until none are due).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Report how many events are due; send none."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("sleep", "batch_size", "max_batches"):
            value = options[name]
            if value is not None and value <= 0:
                raise CommandError(f"--{name.replace('_', '-')} must be positive.", returncode=2)
        verbosity = int(options["verbosity"])
        if options["dry_run"]:
            due = OutboxEvent.objects.due().count()
            dead = OutboxEvent.objects.dead().count()
            self.stdout.write(f"{due} events due, {dead} dead; nothing sent (dry run).")
            return
        with Relay(batch_size=options["batch_size"]) as relay:
            if options["loop"]:
                self._loop(relay, options["sleep"], verbosity)
                return
            try:
                stats = relay.drain(max_batches=options["max_batches"])
            except DatabaseError as exc:
                raise CommandError(
                    f"The outbox's database {relay.using!r} failed: {describe(exc)}. Nothing "
                    "was lost: events not recorded as published are sent again by the next pass."
                ) from exc
            failures = relay.failures()
        self._report(stats, verbosity, always=True)
        if stats.failed or stats.dead:
            raise CommandError(
                f"{stats.failed + stats.dead} events failed to publish; they stay in the outbox, "
                "retried after their backoff (DEAD ones wait in the admin):\n"
                + "\n".join(f"  {failure}" for failure in failures),
                returncode=EXIT_FAILURES,
            )

    def _loop(self, relay: Relay, sleep: float | None, verbosity: int) -> None:
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        poll = sleep if sleep is not None else conf.OUTBOX_POLL_SECONDS
        if verbosity >= 1:
            self.stdout.write(f"Relaying outbox events (poll every {poll:g} s); Ctrl-C stops.")
        seen: dict[str, str] = {}

        def report(stats: RelayStats) -> None:
            # A failing route is named once per cause, not on every pass of an outage.
            new = [
                failure
                for failure in relay.failures()
                if (stats.failed or stats.dead) and seen.get(failure.route) != failure.cause
            ]
            seen.update((failure.route, failure.cause) for failure in new)
            self._report(stats, verbosity, always=False, failures=new)

        relay.run_forever(stop, poll_seconds=poll, on_pass=report)
        if verbosity >= 1:
            self.stdout.write("Relay stopped.")

    def _report(
        self,
        stats: RelayStats,
        verbosity: int,
        *,
        always: bool,
        failures: list[RouteFailure] | None = None,
    ) -> None:
        if verbosity < 1 or not (always or stats.claimed or verbosity >= 3):
            return
        line = ", ".join(f"{value} {name}" for name, value in stats.as_dict().items())
        style = self.style.WARNING if stats.failed or stats.dead else self.style.SUCCESS
        self.stdout.write(style(line))
        for failure in failures or ():
            self.stdout.write(self.style.WARNING(f"  {failure}"))
