"""Check the guarantees on this project's own settings, databases, routers and Redis."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency.operations.verify import PLAN, VerifyOptions, verify


class Command(BaseCommand):
    help = (
        "Check that the idempotency guarantees hold on this project's settings and databases: "
        "concurrent duplicates, a request killed mid-view, fingerprint mismatches, replays, "
        "transactions and routers, a relay killed before its ack, a Redis outage. Uses scratch "
        "keys, markers and events only, deletes them afterwards, prints a table with the "
        "evidence and exits non-zero on any failure."
    )
    # It runs the app's system checks itself and reports them in its table.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--url",
            default=None,
            help="Also send the HTTP checks (concurrent duplicates, 422, replay) to this "
            "endpoint of a running deployment, as POSTs with scratch keys. Only name an "
            "endpoint that is safe to call: the first request of each key runs its view.",
        )
        parser.add_argument(
            "--header",
            action="append",
            default=[],
            metavar="NAME: VALUE",
            help="A header for the --url requests, such as an Authorization (repeatable).",
        )
        parser.add_argument(
            "--body",
            default='{"idempotency_verify": true}',
            help="The JSON body of the --url requests.",
        )
        parser.add_argument(
            "--outbox-topic",
            default=None,
            help="Send the outbox check's scratch events through the route configured for "
            "this topic (a real broker, whose consumers receive them, some twice) instead of "
            "the in-memory publisher.",
        )
        parser.add_argument(
            "--lease-seconds",
            type=float,
            default=2.0,
            help="Lease of the request and the relay the checks kill (default 2).",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=6,
            help="Duplicate requests sent at once (default 6).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="List the checks and what they write, and run none of them.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["lease_seconds"] <= 0 or options["concurrency"] < 2:
            raise CommandError(
                "--lease-seconds must be positive and --concurrency at least 2.", returncode=2
            )
        headers = {}
        for header in options["header"]:
            name, colon, value = header.partition(":")
            if not colon or not name.strip():
                raise CommandError(
                    f"--header must read 'Name: value', not {header!r}.", returncode=2
                )
            headers[name.strip()] = value.strip()
        if options["dry_run"]:
            for name, writes in PLAN:
                self.stdout.write(f"{name}: {writes}")
            return
        report = verify(
            VerifyOptions(
                url=options["url"],
                url_headers=headers,
                url_body=options["body"].encode(),
                outbox_topic=options["outbox_topic"],
                lease_seconds=options["lease_seconds"],
                concurrency=options["concurrency"],
            )
        )
        if int(options["verbosity"]) >= 1 or not report.ok:
            self.stdout.write(f"idempotency_verify run {report.run}")
            self.stdout.write(report.table())
        if not report.ok:
            failed = ", ".join(result.name for result in report.failed)
            raise CommandError(
                f"{len(report.failed)} of {len(report.results)} checks failed: {failed}."
            )
        if int(options["verbosity"]) >= 1:
            self.stdout.write(self.style.SUCCESS("Every check passed."))
