"""Play the idempotency story against a running demo server and check every step.

Talks to the server over HTTP only, like any client would: it needs no access to the database,
so it works against ``make demo``, docker compose, or any other deployment of the demo.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.core.management.base import BaseCommand, CommandError

from django_idempotency.client import IdempotentClient, RetryPolicy

SOURCE, DESTINATION = "acc_1", "acc_2"
COMPLETED, REFUNDED = "payment.completed", "payment.refunded"


@dataclass
class Answer:
    """One HTTP exchange; ``status`` is None when the connection died before any answer."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None

    @property
    def error(self) -> str | None:
        return self.body.get("error") if isinstance(self.body, dict) else None

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replay") == "true"

    def describe(self) -> str:
        if self.status is None:
            return "no answer: the connection was dropped"
        detail = self.error or ("replayed" if self.replayed else "")
        retry_after = self.headers.get("retry-after")
        if retry_after:
            detail += f", Retry-After: {retry_after}"
        return f"{self.status} {detail}".strip()


def answer_of(response: httpx.Response) -> Answer:
    """An httpx response (from :class:`IdempotentClient`) as the tour shows answers."""
    try:
        parsed = response.json() if response.content else None
    except ValueError:
        parsed = response.text
    return Answer(response.status_code, {k.lower(): v for k, v in response.headers.items()}, parsed)


def payment(amount: str, source: str = SOURCE, destination: str = DESTINATION) -> dict[str, str]:
    return {
        "amount": amount,
        "currency": "USD",
        "source_account": source,
        "destination_account": destination,
    }


class Client:
    def __init__(self, base_url: str, credentials: tuple[str, str] | None, timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CommandError(f"--url must be an http(s) URL, not {base_url!r}")
        self.parts = parts
        self.timeout = timeout
        self.auth = None
        if credentials:
            token = base64.b64encode(":".join(credentials).encode()).decode()
            self.auth = f"Basic {token}"

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Answer:
        connection_class = (
            http.client.HTTPSConnection
            if self.parts.scheme == "https"
            else http.client.HTTPConnection
        )
        connection = connection_class(self.parts.netloc, timeout=self.timeout)
        all_headers = {"Accept": "application/json", **(headers or {})}
        if self.auth:
            all_headers["Authorization"] = self.auth
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        try:
            connection.request(
                method, self.parts.path.rstrip("/") + path, body=payload, headers=all_headers
            )
            response = connection.getresponse()
            raw = response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            return Answer(None)  # the server died while handling the request
        except OSError as exc:
            raise CommandError(
                f"Cannot reach the demo at {self.parts.geturl()}: {exc}. Start it with `make demo`."
            ) from exc
        finally:
            connection.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, parsed)

    def pay(
        self,
        key: str | None,
        amount: str,
        fault: str | None = None,
        *,
        source: str = SOURCE,
        destination: str = DESTINATION,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        all_headers = dict(headers or {})
        if key is not None:
            all_headers["Idempotency-Key"] = key
        if fault is not None:
            all_headers["X-Demo-Fault"] = fault
        return self.request(
            "POST", "/api/v1/payments/", payment(amount, source, destination), all_headers
        )

    def ledger(self, transaction_id: str) -> list[dict[str, Any]]:
        answer = self.request("GET", f"/api/v1/ledger/?payment={transaction_id}")
        if answer.status != 200 or not isinstance(answer.body, list):
            raise CommandError(f"GET /api/v1/ledger/ answered {answer.describe()}")
        return answer.body

    def balances(self) -> dict[str, Decimal]:
        answer = self.request("GET", "/api/v1/accounts/")
        if answer.status != 200 or not isinstance(answer.body, list):
            raise CommandError(f"GET /api/v1/accounts/ answered {answer.describe()}")
        return {account["name"]: Decimal(account["balance"]) for account in answer.body}


class Command(BaseCommand):
    help = (
        "Play retries, a double submit, a reused key, a crash and a payout handed to a worker "
        "against a running demo server, and check that every payment moved money and reached "
        "the ledger exactly once."
    )
    # Only HTTP: the server under tour may run with other settings than this process.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--url", default="http://127.0.0.1:8000", help="The demo server (default: %(default)s)."
        )
        parser.add_argument("--user", help="Authenticate as this user (default: anonymous).")
        parser.add_argument("--password", help="The user's password.")
        parser.add_argument(
            "--timeout", type=float, default=60.0, help="Seconds to wait for any one answer."
        )
        parser.add_argument(
            "--no-verify",
            action="store_true",
            help="Do not end with manage.py idempotency_verify on this process's settings.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        credentials = None
        if options["user"]:
            credentials = (options["user"], options["password"] or "")
        self.client = Client(options["url"], credentials, options["timeout"])
        # What a real client should use: one key per payment, retried on dropped connections, 409
        # (after its Retry-After) and 5xx, never a second payment (django_idempotency.client).
        self.retrying = IdempotentClient(
            options["url"].rstrip("/"),
            auth=credentials,
            timeout=options["timeout"],
            headers={"Accept": "application/json"},
            sleep=self.wait,
        )
        self.failures: list[str] = []
        self.moved = Decimal("0.00")
        #: transaction_id -> (amount, the topics of its events, in order).
        self.payments: dict[str, tuple[str, list[str]]] = {}
        self.timeout = options["timeout"]
        self.run_id = uuid.uuid4().hex[:8]
        self.waits_announced: list[float] = []

        info = self.client.request("GET", "/api/v1/demo/")
        if info.status != 200 or not isinstance(info.body, dict):
            raise CommandError(f"GET /api/v1/demo/ answered {info.describe()}; is this the demo?")
        self.info = info.body
        self.stdout.write(
            f"Touring {options['url']} ({self.info['database']}, lease "
            f"{self.info['lease_seconds']:g} s, faults {'on' if self.info['faults'] else 'off'})"
        )
        before = self.client.balances()
        self.stdout.write(f"Balances before: {self._format(before)}\n")

        steps: list[Callable[[], None]] = [
            self.first_payment_and_retry,
            self.status_by_key,
            self.double_submit,
            self.payload_mismatch,
            self.missing_and_invalid_key,
            self.crash_mid_payment,
            self.payout_handed_off,
            self.refund_and_retry,
            self.events_once,
        ]
        # The client logs each retry at INFO, which the demo's LOGGING prints for the server's
        # sake; the tour reports the retries in its own lines instead.
        client_log = logging.getLogger("django_idempotency.client")
        level = client_log.level
        client_log.setLevel(logging.WARNING)
        try:
            for number, step in enumerate(steps, start=1):
                self.stdout.write(self.style.MIGRATE_HEADING(f"{number}. {step.__doc__}"))
                step()
        finally:
            client_log.setLevel(level)
            self.retrying.close()

        after = self.client.balances()
        expected = {
            SOURCE: before[SOURCE] - self.moved,
            DESTINATION: before[DESTINATION] + self.moved,
        }
        self.stdout.write(f"\nBalances after:  {self._format(after)}")
        self.expect(
            all(after[name] == expected[name] for name in expected),
            f"every duplicate left the balances alone: {SOURCE} and {DESTINATION} moved by "
            f"{self.moved} exactly once",
            f"expected {self._format(expected)}",
        )
        if self.failures:
            raise CommandError(f"{len(self.failures)} check(s) failed: {'; '.join(self.failures)}")
        self.stdout.write(self.style.SUCCESS("\nThe tour ran green."))
        if not options["no_verify"]:
            self.verify()

    def verify(self) -> None:
        """Last, the guarantees on this stack: ``manage.py idempotency_verify``, the command to
        run first on any project of your own."""
        from django.conf import settings
        from django.core.management import call_command

        self.stdout.write(self.style.MIGRATE_HEADING("\nThe guarantees on this stack"))
        engine = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        if engine != self.info["database"]:
            # The server runs elsewhere (docker compose): this process's database is not its.
            self.stdout.write(
                f"The server runs on {self.info['database']}, this process on {engine}: run "
                "`python manage.py idempotency_verify` where the server runs (docker compose "
                "exec web python manage.py idempotency_verify)."
            )
            return
        call_command("idempotency_verify", stdout=self.stdout, stderr=self.stderr)

    # --- steps -----------------------------------------------------------------------------

    def first_payment_and_retry(self) -> None:
        """A payment, then the client retries it (its response was lost)."""
        key = self.key("pay")
        first = self.client.pay(key, "25.00")
        self.show("POST 25.00", first)
        self.expect(first.status == 201 and not first.replayed, "the payment ran", "expected 201")
        self.payment = first.body or {}
        if first.status == 201:
            self.paid(first, "25.00")
        self.first_key = key
        # The retry, as django_idempotency.client sends it: the same key, the same body.
        retry = answer_of(self.retrying.post("/api/v1/payments/", key=key, json=payment("25.00")))
        self.show("retry, same key", retry)
        self.expect(
            retry.status == 201 and retry.replayed and retry.body == first.body,
            "the retry got the stored answer (same transaction_id), no second payment",
            "expected 201 with Idempotent-Replay: true and the same body",
        )

    def status_by_key(self) -> None:
        """The client asks the server about its key instead of retrying."""
        base = "/api/v1/idempotency-keys/"
        status = self.client.request("GET", base + self.first_key)
        self.show("GET idempotency-keys/<first key>", status)
        body = status.body if isinstance(status.body, dict) else {}
        if status.status == 200:
            self.stdout.write(
                f"     status {body.get('status')}, response {body.get('response_status')}, "
                f"expires {body.get('expires')}"
            )
        link = status.headers.get("link", "")
        self.expect(
            status.status == 200
            and body.get("status") == "completed"
            and body.get("response_status") == 201
            and 'rel="response"' in link,
            "the key is completed, with a Link to its stored response",
            "expected 200 with status completed and a Link",
        )
        target = link[link.find("<") + 1 : link.find(">")]
        path = urlsplit(target).path[len(self.client.parts.path.rstrip("/")) :]
        stored = self.client.request("GET", path or base + self.first_key + "/response")
        self.show("GET the Link", stored)
        self.expect(
            stored.status == 201 and stored.replayed and stored.body == self.payment,
            "the stored response, as a retry would get it: the same payment",
            "expected 201 replayed with the first payment's body",
        )
        unknown = self.client.request("GET", base + self.key("never-sent"))
        self.show("GET idempotency-keys/<unknown>", unknown)
        self.expect(
            unknown.status == 404 and unknown.error == "idempotency_key_not_found",
            "an unknown key (or another client's) is 404, whichever it is",
            "expected 404",
        )

    def double_submit(self) -> None:
        """A double submit: two identical requests at once."""
        if not self.info["faults"]:
            self.skip("needs DEMO_FAULTS=1 to hold the first request open (make demo sets it)")
            return
        key = self.key("double")
        slow = f"slow={min(3.0, self.info['lease_seconds'] / 2):g}"
        answers: list[Answer] = []

        def send() -> None:
            answers.append(self.client.pay(key, "10.00", fault=slow))

        first = threading.Thread(target=send)
        first.start()
        time.sleep(0.5)
        second = self.client.pay(key, "10.00", fault=slow)
        first.join()
        answers.append(second)
        for answer in answers:
            self.show("POST 10.00", answer)
        statuses = sorted(answer.status or 0 for answer in answers)
        conflict = next((answer for answer in answers if answer.status == 409), None)
        self.expect(
            statuses == [201, 409]
            and conflict is not None
            and conflict.error == "transaction_in_progress"
            and "retry-after" in conflict.headers,
            "one ran, the other was told to retry later (409 transaction_in_progress)",
            f"expected one 201 and one 409, got {statuses}",
        )
        for answer in answers:
            if answer.status == 201:
                self.paid(answer, "10.00")
        retry = self.client.pay(key, "10.00")
        self.show("retry after both", retry)
        self.expect(retry.status == 201 and retry.replayed, "the retry got the stored answer", "")

    def payload_mismatch(self) -> None:
        """The first key reused for a different amount."""
        key = self.key("pay")
        answer = self.client.pay(key, "99.00")
        self.show("POST 99.00, first key", answer)
        self.expect(
            answer.status == 422 and answer.error == "payload_mismatch",
            "refused: a key names one request (422 payload_mismatch)",
            "expected 422",
        )

    def missing_and_invalid_key(self) -> None:
        """No key, then a key that is not one."""
        missing = self.client.pay(None, "1.00")
        self.show("POST without a key", missing)
        self.expect(
            missing.status == 400 and missing.error == "idempotency_key_missing",
            "refused before any work (400 idempotency_key_missing)",
            "expected 400",
        )
        invalid = self.client.pay("x" * 300, "1.00")
        self.show("POST with a 300-character key", invalid)
        self.expect(
            invalid.status == 400 and invalid.error == "idempotency_key_invalid",
            "refused before any work (400 idempotency_key_invalid)",
            "expected 400",
        )

    def crash_mid_payment(self) -> None:
        """The server process dies in the middle of a payment."""
        if not self.info["faults"]:
            self.skip("needs DEMO_FAULTS=1 and a server that survives a dying worker (make demo)")
            return
        key = self.key("crash")
        crashed = self.client.pay(key, "5.00", fault="crash")
        self.show("POST 5.00, worker killed", crashed)
        self.expect(crashed.status is None, "the client got no answer and must retry", "")
        # The client retries at once with the same key. PostgreSQL and MariaDB know the dead
        # request's connection is gone and let the retry take its key over at once; on SQLite
        # the key waits for the dead request's lease, and the client for its Retry-After.
        lease = float(self.info["lease_seconds"])
        patient = IdempotentClient(
            client=self.retrying.client,
            sleep=self.wait,
            policy=RetryPolicy(max_attempts=50, deadline=lease + 60, max_retry_after=lease + 5),
        )
        self.waits_announced.clear()
        response = patient.post("/api/v1/payments/", key=key, json=payment("5.00"))
        attempts = len(self.waits_announced) + 1
        answer = answer_of(response)
        self.show(f"retried by the client, {attempts} attempt(s)", answer)
        self.expect(
            answer.status == 201 and not answer.replayed,
            "taken over and run once: the dead attempt's writes had rolled back",
            "expected 201",
        )
        if answer.status == 201:
            self.paid(answer, "5.00")

    def payout_handed_off(self) -> None:
        """A payout: 202 at once, a duplicate attaches, the worker completes it."""
        key = self.key("payout")
        accepted = self.client.request(
            "POST", "/api/v1/payouts/", payment("7.00"), {"Idempotency-Key": key}
        )
        self.show("POST /payouts/ 7.00", accepted)
        location = accepted.headers.get("location", "")
        self.expect(
            accepted.status == 202 and location.endswith(f"/idempotency-keys/{key}"),
            "accepted at once (202), Location: the key's status URL",
            "expected 202 with a Location",
        )
        status = self.client.request("GET", urlsplit(location).path[len(self.prefix) :])
        self.show("GET Location", status)
        body = status.body if isinstance(status.body, dict) else {}
        self.expect(
            status.status == 200 and body.get("status") in ("processing", "completed"),
            f"the payout is {body.get('status')} (the worker takes "
            f"{self.info['payout_seconds']:g} s)",
            "expected 200 with a status",
        )
        # The client lost the 202 and asks again, willing to wait for the final answer.
        wait = int(self.info["payout_seconds"]) + 8
        attached = self.client.request(
            "POST",
            "/api/v1/payouts/",
            payment("7.00"),
            {"Idempotency-Key": key, "Prefer": f"wait={wait}"},
        )
        self.show(f"duplicate, Prefer: wait={wait}", attached)
        self.expect(
            attached.status == 201
            and attached.replayed
            and "preference-applied" in attached.headers,
            "the duplicate attached: it waited for the worker and got the payout (201)",
            "expected 201 replayed, with Preference-Applied",
        )
        final = self.client.request("GET", urlsplit(location).path[len(self.prefix) :])
        final_body = final.body if isinstance(final.body, dict) else {}
        self.show("GET Location", final)
        self.expect(
            final.status == 200
            and final_body.get("status") == "completed"
            and final_body.get("response_status") == 201,
            "the key is completed: the payout's answer is stored under it, once",
            "expected status completed with response 201",
        )
        if attached.status == 201:
            self.paid(attached, "7.00")

    @property
    def prefix(self) -> str:
        """The path the demo is served under (none for ``make demo``)."""
        return self.client.parts.path.rstrip("/")

    def refund_and_retry(self) -> None:
        """A refund (PATCH), retried."""
        transaction_id = self.payment.get("transaction_id")
        if not transaction_id:
            self.skip("the first payment did not succeed")
            return
        key = self.key("refund")
        path = f"/api/v1/payments/{transaction_id}/"
        answers = [
            self.client.request("PATCH", path, {"status": "refunded"}, {"Idempotency-Key": key})
            for _ in range(2)
        ]
        for answer in answers:
            self.show("PATCH refunded", answer)
        first, retry = answers
        self.expect(
            first.status == 200 and retry.status == 200 and retry.replayed,
            "refunded once; the retry got the stored answer, not a second refund",
            "expected 200 twice, the second replayed",
        )
        if first.status == 200:
            self.moved -= Decimal("25.00")
            self.payments[transaction_id][1].append(REFUNDED)

    def events_once(self) -> None:
        """Each payment's event: published once, consumed once (the ledger)."""
        where = "by the Celery worker" if self.info["broker"] else "in the server's process"
        self.stdout.write(f"   (the outbox relays each event, the ledger consumer runs {where})")
        ledger_moved = Decimal("0.00")
        for transaction_id, (amount, topics) in self.payments.items():
            entries = self.wait_for_ledger(transaction_id, 2 * len(topics))
            self.stdout.write(f"   payment {transaction_id[:8]}... of {amount}")
            for entry in entries:
                self.stdout.write(
                    f"     {entry['topic']:<18} {entry['side']:<6} {entry['account']} "
                    f"{entry['amount']}  (event {entry['event_id'][:8]}...)"
                )
                if entry["account"] == SOURCE:
                    sign = 1 if entry["side"] == "debit" else -1
                    ledger_moved += sign * Decimal(entry["amount"])
            self.expect(
                _pairs(entries) == [_pair(topic) for topic in topics],
                f"{' and '.join(topics)} consumed once: one debit, one credit "
                f"{'each' if len(topics) > 1 else ''}".strip(),
                f"expected {[_pair(topic) for topic in topics]}, got {_pairs(entries)}",
            )
        self.expect(
            ledger_moved == self.moved,
            f"the ledger agrees with the balances: {SOURCE} paid {self.moved} net, once",
            f"the ledger says {ledger_moved}",
        )

    def wait_for_ledger(self, transaction_id: str, count: int) -> list[dict[str, Any]]:
        """The payment's entries once there are ``count`` (the consumer runs after the commit)."""
        deadline = time.monotonic() + self.timeout
        entries = self.client.ledger(transaction_id)
        while len(entries) < count and time.monotonic() < deadline:
            time.sleep(0.5)
            entries = self.client.ledger(transaction_id)
        if len(entries) < count and self.info["broker"]:
            self.stdout.write(
                self.style.WARNING("     no entries yet: is the Celery worker running?")
            )
        return entries

    def paid(self, answer: Answer, amount: str) -> None:
        self.moved += Decimal(amount)
        self.payments[answer.body["transaction_id"]] = (amount, [COMPLETED])

    def wait(self, seconds: float) -> None:
        """The retrying client's sleep: said, then slept."""
        self.waits_announced.append(seconds)
        self.stdout.write(f"     the client waits {seconds:.1f} s before retrying ...")
        time.sleep(seconds)

    # --- output ----------------------------------------------------------------------------

    def key(self, name: str) -> str:
        return f"tour-{self.run_id}-{name}"

    def show(self, label: str, answer: Answer) -> None:
        self.stdout.write(f"   {label:<32} -> {answer.describe()}")

    def expect(self, ok: bool, success: str, failure: str) -> None:
        if ok:
            self.stdout.write(self.style.SUCCESS(f"   ok: {success}"))
        else:
            self.failures.append(f"{success} ({failure})" if failure else success)
            self.stdout.write(self.style.ERROR(f"   FAILED: {success}. {failure}"))

    def skip(self, reason: str) -> None:
        self.stdout.write(self.style.WARNING(f"   skipped: {reason}"))

    def _format(self, balances: dict[str, Decimal]) -> str:
        return ", ".join(f"{name} {balances[name]}" for name in (SOURCE, DESTINATION))


def _pair(topic: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What one event of ``topic`` writes for a tour payment (from SOURCE to DESTINATION)."""
    payer, payee = (SOURCE, DESTINATION) if topic == COMPLETED else (DESTINATION, SOURCE)
    return topic, (("credit", payee), ("debit", payer))


def _pairs(entries: list[dict[str, Any]]) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """The entries grouped by event, in the order the events were written."""
    events: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        events.setdefault(entry["event_id"], []).append(entry)
    return [
        (group[0]["topic"], tuple(sorted((entry["side"], entry["account"]) for entry in group)))
        for group in events.values()
    ]
