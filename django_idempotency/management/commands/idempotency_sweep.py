"""Delete expired idempotency records, old published events and old consumer markers."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency.operations.sweeps import SWEEPS


class Command(BaseCommand):
    help = (
        "Delete expired idempotency records, events published longer ago than "
        "OUTBOX_RETENTION_SECONDS and processed messages older than INBOX_RETENTION_SECONDS, "
        "in batches of short transactions."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--only",
            action="append",
            choices=sorted(SWEEPS),
            help="Run only this sweep (repeatable). Default: all of them.",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            help="Rows per delete (default: SWEEP_BATCH_SIZE).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what is due without deleting it."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size = options["batch_size"]
        if batch_size is not None and batch_size <= 0:
            raise CommandError("--batch-size must be positive.", returncode=2)
        verbosity = int(options["verbosity"])
        dry_run = bool(options["dry_run"])
        names = options["only"] or list(SWEEPS)
        verb = "would delete" if dry_run else "deleted"
        total = 0
        for name in names:
            if verbosity >= 2:
                self.stdout.write(f"Sweeping {name}...")
            count = SWEEPS[name](batch_size=batch_size, dry_run=dry_run)
            total += count
            if verbosity >= 1:
                self.stdout.write(f"{name}: {verb} {count}")
        if verbosity >= 1:
            self.stdout.write(self.style.SUCCESS(f"Total: {verb} {total}"))
