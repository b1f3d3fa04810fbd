"""Create the app's periodic tasks in django-celery-beat's tables, keeping any that exist."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency.tasks import BEAT_SCHEDULE, install_periodic_tasks


class Command(BaseCommand):
    help = (
        "For django-celery-beat's DatabaseScheduler: create the periodic tasks of "
        "django_idempotency.tasks.BEAT_SCHEDULE that are missing. Those already in the database "
        "(changed in the admin or not) are left as they are, unless --reset."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--reset",
            action="store_true",
            help="Put the shipped interval, expiry and task back on the entries that exist.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Say what would be done; change nothing."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not apps.is_installed("django_celery_beat"):
            raise CommandError(
                "django-celery-beat is not in INSTALLED_APPS. This command is for its "
                "DatabaseScheduler (pip install django-celery-beat, add 'django_celery_beat' to "
                "INSTALLED_APPS, run migrate). With Celery's own scheduler, merge "
                "django_idempotency.tasks.BEAT_SCHEDULE into CELERY_BEAT_SCHEDULE instead.",
                returncode=2,
            )
        verbosity = int(options["verbosity"])
        dry_run = bool(options["dry_run"])
        outcomes = install_periodic_tasks(reset=bool(options["reset"]), dry_run=dry_run)
        for name, outcome in outcomes.items():
            entry = BEAT_SCHEDULE[name]
            if verbosity >= 1:
                verb = f"would be {outcome}" if dry_run and outcome != "kept" else outcome
                shipped = (
                    f"every {entry['schedule']:g} s, expires after "
                    f"{entry['options']['expires']:g} s"
                )
                detail = "as it is in the database" if outcome == "kept" else shipped
                self.stdout.write(f"{name}: {verb} ({detail})")
        overwritten = sorted(set(_configured_beat_schedule()) & set(BEAT_SCHEDULE))
        if overwritten:
            self.stderr.write(
                self.style.WARNING(
                    f"CELERY_BEAT_SCHEDULE also lists {', '.join(overwritten)}: "
                    "DatabaseScheduler rewrites those periodic tasks from the setting at every "
                    "start, undoing changes made in the admin. Remove them from the setting."
                )
            )


def _configured_beat_schedule() -> dict[str, Any]:
    """The beat schedule in the settings and in the Celery app in use (the project's, once its
    package imported it)."""
    from celery import current_app
    from django.conf import settings

    return {
        **getattr(settings, "CELERY_BEAT_SCHEDULE", {}),
        **(current_app.conf.beat_schedule or {}),
    }
