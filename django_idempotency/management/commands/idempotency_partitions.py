"""Day partitions of the idempotency records (``RECORD_PARTITIONS``), outbox events
(``OUTBOX_PARTITIONS``) or inbox markers (``INBOX_PARTITIONS``) table on PostgreSQL."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency.db import database_now
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.management.commands.idempotency_sweep import moment
from django_idempotency.operations import partitions

ACTIONS = ("maintain", "create", "retention", "status", "partition", "unpartition")


class Command(BaseCommand):
    help = (
        "Day partitions of the idempotency records table (PostgreSQL, RECORD_PARTITIONS), or "
        "with --table outbox (inbox) of the outbox events (inbox markers) table "
        "(OUTBOX_PARTITIONS, INBOX_PARTITIONS): "
        "'maintain' creates the partitions ahead and drops expired ones (what the hourly task "
        "does); 'create' and 'retention' do one of the two; 'status' lists the partitions; "
        "'partition' moves the plain table to the partitioned layout with writes continuing, "
        "'unpartition' moves it back (writes wait for the copy). See docs/partitions.md."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=ACTIONS, nargs="?", default="maintain")
        parser.add_argument(
            "--table",
            choices=sorted(partitions.LAYOUTS),
            default=partitions.RECORDS.label,
            help="Which table: the idempotency records (default), the outbox events or the "
            "inbox markers.",
        )
        parser.add_argument(
            "--ahead-days",
            type=int,
            default=None,
            help="Create partitions this many days ahead (default: PARTITION_AHEAD_DAYS).",
        )
        parser.add_argument(
            "--bound",
            type=moment,
            default=None,
            metavar="WHEN",
            help="'partition': where the plain table's range ends (default: the first "
            "partition boundary at least an hour from now).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="'create', 'retention', 'maintain': say what would be done, do nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        self.verbosity = int(options["verbosity"])
        dry_run = bool(options["dry_run"])
        ahead = options["ahead_days"]
        self.layout = layout = partitions.LAYOUTS[options["table"]]
        if ahead is not None and ahead < 0:
            raise CommandError("--ahead-days must be 0 or more.", returncode=2)
        if action == "maintain" and not (
            layout.enabled and partitions.is_partitioned(layout=layout)
        ):
            # What cron runs: nothing to do (and no error) until the table is partitioned.
            if self.verbosity >= 1:
                self.stdout.write(
                    f"Nothing to maintain: {layout.setting} is off or the {layout.label} table "
                    "is not partitioned."
                )
            return
        try:
            if action in ("maintain", "create"):
                self._create(ahead, dry_run)
            if action in ("maintain", "retention"):
                self._retention(dry_run)
            if action == "status":
                self._status()
            if action == "partition":
                bound = partitions.partition_table(
                    bound=options["bound"], ahead_days=ahead, verbose=self._say, layout=layout
                )
                self.stdout.write(
                    self.style.SUCCESS(
                        f"The {layout.label} table is partitioned; the plain table is the "
                        f"partition "
                        f"{partitions.LEGACY_SUFFIX.strip('_')} up to {bound.isoformat()}."
                    )
                )
            if action == "unpartition":
                seconds = partitions.unpartition_table(verbose=self._say, layout=layout)
                self.stdout.write(
                    self.style.SUCCESS(
                        f"The {layout.label} table is one plain table again (writes waited "
                        f"{seconds:.2f} s). Turn IDEMPOTENCY[{layout.setting!r}] off."
                    )
                )
        except IdempotencyConfigurationError as exc:
            raise CommandError(str(exc)) from exc

    def _say(self, message: str) -> None:
        if self.verbosity >= 2:
            self.stdout.write(message)

    def _create(self, ahead: int | None, dry_run: bool) -> None:
        created = partitions.create_partitions(
            ahead_days=ahead, dry_run=dry_run, layout=self.layout
        )
        verb = "would create" if dry_run else "created"
        if self.verbosity >= 1:
            self.stdout.write(f"{verb} {len(created)} partitions")
        for name in created:
            self._say(f"  {name}")

    def _retention(self, dry_run: bool) -> None:
        refused = []
        live = self.layout.live_rows
        for outcome in partitions.apply_retention(dry_run=dry_run, layout=self.layout):
            if outcome.action == "refused":
                refused.append(outcome)
                self.stderr.write(
                    f"refused to drop {outcome.partition}: it holds {outcome.live} {live}"
                    + (f": {outcome.detail}" if outcome.detail else "")
                )
            elif self.verbosity >= 1:
                verb = "would drop" if outcome.action == "due" else "dropped"
                self.stdout.write(f"{verb} {outcome.partition}")
        if refused:
            raise CommandError(
                f"{len(refused)} partition(s) past {self.layout.retention_setting} still hold "
                "live rows and were kept; retention tries them again at its next run.",
                returncode=1,
            )

    def _status(self) -> None:
        layout = self.layout
        if not partitions.is_partitioned(layout=layout):
            self.stdout.write(f"The {layout.label} table is not partitioned.")
            return
        now = database_now(layout.using())
        for part in partitions.partitions(layout=layout):
            start = "MINVALUE" if part.start is None else part.start.isoformat()
            live = partitions.live_rows(part.name, now, layout=layout)
            self.stdout.write(f"{part.name}  [{start}, {part.end.isoformat()})  live: {live}")
