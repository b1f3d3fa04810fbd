"""Delete expired idempotency records, old published events and old consumer markers."""

from __future__ import annotations

import argparse
import re
from datetime import datetime, time, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from django_idempotency.operations.sweeps import SWEEPS

_OFFSET = re.compile(r"\+(?P<amount>\d+(?:\.\d+)?)(?P<unit>[smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def moment(value: str) -> datetime:
    """``--now``: an ISO 8601 date or time (naive ones in ``TIME_ZONE``), or ``+N`` seconds,
    minutes, hours or days from now (``+36h``)."""
    offset = _OFFSET.fullmatch(value.strip())
    if offset:
        seconds = float(offset["amount"]) * _UNIT_SECONDS[offset["unit"]]
        return timezone.now() + timedelta(seconds=seconds)
    try:
        parsed = parse_datetime(value)
        if parsed is None and (day := parse_date(value)) is not None:
            parsed = datetime.combine(day, time())
    except ValueError:
        parsed = None
    if parsed is None:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither an ISO 8601 date or time (2030-01-01T00:00:00Z) nor an "
            "offset from now (+30s, +15m, +36h, +2d)"
        )
    return parsed if timezone.is_aware(parsed) else timezone.make_aware(parsed)


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
        parser.add_argument(
            "--now",
            type=moment,
            default=None,
            metavar="WHEN",
            help="Sweep as if it were WHEN: an ISO 8601 date or time (2030-01-01T00:00:00Z; "
            "naive ones in TIME_ZONE) or an offset from now (+36h, +2d). Default: the "
            "database's current time.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size = options["batch_size"]
        if batch_size is not None and batch_size <= 0:
            raise CommandError("--batch-size must be positive.", returncode=2)
        verbosity = int(options["verbosity"])
        dry_run = bool(options["dry_run"])
        names = options["only"] or list(SWEEPS)
        verb = "would delete" if dry_run else "deleted"
        if options["now"] is not None and verbosity >= 2:
            self.stdout.write(f"Sweeping as of {options['now'].isoformat()}")
        total = 0
        for name in names:
            if verbosity >= 2:
                self.stdout.write(f"Sweeping {name}...")
            count = SWEEPS[name](batch_size=batch_size, now=options["now"], dry_run=dry_run)
            if count is None:
                if verbosity >= 1:
                    self.stdout.write(f"{name}: skipped, the previous sweep still runs")
                continue
            total += count
            if verbosity >= 1:
                self.stdout.write(f"{name}: {verb} {count}")
        if verbosity >= 1:
            self.stdout.write(self.style.SUCCESS(f"Total: {verb} {total}"))
