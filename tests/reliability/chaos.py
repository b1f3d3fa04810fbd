"""``make chaos``: the demo payments API under load while its processes and services are broken
on a schedule; afterwards every effect is counted in the database and reported in one table.

What runs, all of it private to the run (the shared services on the standard ports are never
touched): a PostgreSQL cluster or a MariaDB server of its own (``--database``; both with
``--database all``), the demo served by gunicorn with the demo's
configuration (several workers), ``manage.py outbox_relay --loop`` processes whose in-process
publisher hands each ``payment.completed`` event to the demo's idempotent ledger consumer, and,
for the second half of the run, a Redis of its own for the idempotency Redis copy.

The load: client threads, each paying one logical payment after another. Every payment has its
own Idempotency-Key and a unique amount, and is sent again after a short backoff until it gets
an answer that is neither a 409 nor a 5xx, as a well-behaved client would.

The faults, on a schedule (``FULL`` / ``SHORT``): gunicorn workers SIGKILLed while a request is
inside its transaction, the database restarted or down for seconds, Redis killed and started
empty, the relay SIGKILLed (with a batch claimed when there is one) and started again. There is
no broker: without ``CELERY_BROKER_URL`` the demo's relay delivers in process, so no broker can
be restarted; the relay's own kills stand for a broken delivery.

Then, from the database: duplicate and lost payments, balances, stuck keys, every event
published and consumed exactly once; from the clients: the longest 409 streak after each kind of
fault, and 5xx answers outside the windows where the database itself was down; from the outbox:
how long events waited to be published. The figures are printed, never asserted here: the
machine's speed is not under test. ``violations()`` lists what breaks a guarantee.

``python -m tests.reliability.chaos [--short] [--database postgresql|mariadb|all]``;
``tests/reliability/test_chaos.py`` runs the short version in CI, on each database.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from tests.reliability.processes import Child
from tests.reliability.services import (
    MARIADBD,
    PrivateDatabase,
    PrivateRedis,
    kill_stale_redis,
    kill_worker_mid_request,
    private_mariadb_server,
    private_postgres_cluster,
)
from tests.support.servers import ROOT, Server, demo_gunicorn, free_port

SETTINGS = "tests.reliability.settings_chaos"
PAYMENTS = "/api/v1/payments/"
CURRENCY = "USD"
OPENING_BALANCE = Decimal("1000000.00")
#: The demo ledger consumer's name (demo_project/payments/tasks.py).
LEDGER = "ledger"
RELAY_STARTED = "Relaying outbox events"
DUPLICATE_SKIPPED = "duplicate message skipped"
LISTEN_LOST = "lost its LISTEN connection"
LISTEN_BACK = "listening for commits again"
#: The target for commit -> publish, outages of up to 10 s included.
LATE_SECONDS = 15.0

# --- the schedule ------------------------------------------------------------------------------

#: The databases a run can use: ``--database`` names, and the servers' own names.
DATABASES = {"postgresql": "PostgreSQL", "mariadb": "MariaDB"}

# Kinds and phases name the database as ``{database}``, filled in by ``named()``.
WORKER = "worker SIGKILL"
DB_RESTART = "{database} restart"
DB_DOWN = "{database} down"
REDIS = "Redis killed"
RELAY = "relay SIGKILL"
KINDS = (WORKER, DB_RESTART, DB_DOWN, REDIS, RELAY)
#: The run's halves: the database alone, then the database behind the Redis copy.
PHASES = ("{database}", "{database} + Redis")


def named(template: str, label: str) -> str:
    """A kind or phase as the report prints it: ``"{database} down"`` -> ``"MariaDB down"``."""
    return template.format(database=label)


@dataclass(frozen=True)
class Planned:
    """A fault ``at`` this fraction of its phase's load; ``down``: how long a stopped service
    stays down."""

    phase: int
    at: float
    kind: str
    down: float = 0.0


FULL = (
    Planned(0, 0.10, WORKER),
    Planned(0, 0.20, RELAY),
    Planned(0, 0.30, DB_RESTART),
    Planned(0, 0.42, WORKER),
    Planned(0, 0.52, DB_DOWN, down=5),
    Planned(0, 0.65, RELAY),
    Planned(0, 0.75, WORKER),
    Planned(0, 0.85, DB_RESTART),
    Planned(1, 0.08, REDIS, down=4),
    Planned(1, 0.18, WORKER),
    Planned(1, 0.28, DB_RESTART),
    Planned(1, 0.38, RELAY),
    Planned(1, 0.48, REDIS, down=4),
    Planned(1, 0.58, WORKER),
    Planned(1, 0.66, DB_DOWN, down=5),
    Planned(1, 0.78, RELAY),
    Planned(1, 0.88, WORKER),
)
SHORT = (
    Planned(0, 0.20, WORKER),
    Planned(0, 0.45, DB_RESTART),
    Planned(0, 0.70, RELAY),
    Planned(1, 0.15, REDIS, down=2),
    Planned(1, 0.40, WORKER),
    Planned(1, 0.65, DB_DOWN, down=3),
)


@dataclass(frozen=True)
class ChaosConfig:
    #: Seconds of load in each phase.
    phase_seconds: float = 90.0
    clients: int = 12
    workers: int = 3
    accounts: int = 20
    relays: int = 1
    #: Share of payments that sleep ``slow_seconds`` inside their transaction (``X-Demo-Fault``),
    #: so that a worker kill finds a request in the middle of its transaction.
    slow_fraction: float = 0.05
    slow_seconds: float = 0.5
    #: The client's pause between two tries of one payment, uniform in this range.
    backoff: tuple[float, float] = (0.2, 0.5)
    #: A client gives a payment up after retrying it this long (reported, and a violation).
    give_up_seconds: float = 150.0
    #: How long the outbox may take to drain once the load is over.
    drain_seconds: float = 180.0
    #: The demo's ``IDEMPOTENCY_LEASE_SECONDS`` / ``IDEMPOTENCY_RELAY_LEASE_SECONDS``; None keeps
    #: the library's defaults (30 s and 60 s).
    lease_seconds: float | None = None
    relay_lease_seconds: float | None = None
    schedule: tuple[Planned, ...] = FULL
    logs: Path = ROOT / "artifacts" / "chaos-logs"

    @classmethod
    def short(cls, **changes: Any) -> ChaosConfig:
        """The CI version: two phases of 20 s, six faults, the leases ``make demo`` uses."""
        short = cls(
            phase_seconds=20,
            clients=8,
            accounts=10,
            give_up_seconds=60,
            # Drained in 2-5 s after the load on an idle 2-core host; CI runs this beside
            # another pass. Waiting longer costs nothing when the relay keeps up.
            drain_seconds=120,
            lease_seconds=5,
            relay_lease_seconds=10,
            # Half the payments sleep inside their transaction: the worker kill waits up to
            # 10 s for one. Beside CI's other passes on a slow day a phase made a payment a
            # second or two, and with one in twenty slow the kill caught none.
            slow_fraction=0.5,
            schedule=SHORT,
        )
        return replace(short, **changes)


# --- what happened -----------------------------------------------------------------------------


@dataclass
class Fault:
    phase: str
    kind: str
    began: float
    #: When it was over: the service answering again, the process replaced.
    ended: float
    detail: str
    #: Whether the database itself was down from ``began`` to ``ended``.
    database_down: bool = False


@dataclass
class Attempt:
    started: float
    finished: float
    #: None: no HTTP answer (connection refused or cut, timeout).
    status: int | None
    error: str = ""


@dataclass
class Order:
    """One logical payment: its key, what it asks for, and every try."""

    key: str
    phase: str
    amount: Decimal
    source: str
    destination: str
    slow: bool
    attempts: list[Attempt] = field(default_factory=list)
    answer: dict[str, Any] | None = None

    @property
    def final(self) -> int | None:
        """The status that ended the retries (neither 409 nor 5xx), None if it was given up."""
        last = self.attempts[-1].status if self.attempts else None
        return last if last is not None and last != 409 and last < 500 else None

    @property
    def paid(self) -> bool:
        return self.final is not None and 200 <= self.final < 300

    def body(self) -> bytes:
        payment = {
            "amount": f"{self.amount:.2f}",
            "currency": CURRENCY,
            "source_account": self.source,
            "destination_account": self.destination,
        }
        return json.dumps(payment).encode()


# --- the clients -------------------------------------------------------------------------------


def _post(port: int, order: Order, config: ChaosConfig) -> tuple[Attempt, bytes]:
    headers = {"Content-Type": "application/json", "Idempotency-Key": order.key}
    if order.slow:
        headers["X-Demo-Fault"] = f"slow={config.slow_seconds:g}"
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    started = time.time()
    try:
        connection.request("POST", PAYMENTS, body=order.body(), headers=headers)
        response = connection.getresponse()
        body = response.read()
        return Attempt(started, time.time(), response.status), body
    except (OSError, http.client.HTTPException) as exc:
        return Attempt(started, time.time(), None, type(exc).__name__), b""
    finally:
        connection.close()


def _pay(port: int, order: Order, config: ChaosConfig, rng: random.Random) -> None:
    """Send ``order`` until it is answered with neither a 409 nor a 5xx, or given up."""
    first = time.time()
    while True:
        attempt, body = _post(port, order, config)
        order.attempts.append(attempt)
        if order.final is not None:
            with contextlib.suppress(ValueError):
                order.answer = json.loads(body)
            return
        if time.time() - first > config.give_up_seconds:
            return
        time.sleep(rng.uniform(*config.backoff))


@dataclass
class Clients:
    """The client threads of one phase, paying until ``deadline``."""

    port: int
    phase: str
    config: ChaosConfig
    prefix: str
    accounts: list[str]
    numbers: Iterator[int]
    deadline: float
    orders: list[Order] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.config.clients):
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(self.config.give_up_seconds + 120)

    def _run(self, index: int) -> None:
        rng = random.Random(f"{self.prefix}-{self.phase}-{index}")
        try:
            while time.time() < self.deadline:
                with self._lock:
                    number = next(self.numbers)
                source, destination = rng.sample(self.accounts, 2)
                order = Order(
                    key=f"{self.prefix}-{number}",
                    phase=self.phase,
                    # Unique per payment, so each payment's effects are found by its amount.
                    amount=Decimal(number + 99) / 100,
                    source=source,
                    destination=destination,
                    slow=rng.random() < self.config.slow_fraction,
                )
                with self._lock:
                    self.orders.append(order)
                _pay(self.port, order, self.config, rng)
        except BaseException as exc:  # reported with the run's violations, never lost
            self.errors.append(exc)


# --- the run -----------------------------------------------------------------------------------


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


def _answers(port: int) -> bool:
    """Whether a worker on ``port`` answers a request (any status)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/")
        connection.getresponse().read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()
    return True


def _wait(condition: Any, timeout: float, every: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(every)
    return bool(condition())


class Sql:
    """The few spellings the checks' SQL needs that differ between PostgreSQL and MariaDB."""

    def __init__(self, postgresql: bool) -> None:
        self.postgresql = postgresql
        #: The records' ``key`` column: a reserved word in MariaDB.
        self.key = "key" if postgresql else "`key`"

    def text(self, uuid: str) -> str:
        """A UUID column as text with dashes, as the API answers and the inbox records it."""
        return f"{uuid}::text" if self.postgresql else f"CAST({uuid} AS CHAR)"

    def json_text(self, column: str, key: str) -> str:
        return f"{column}->>'{key}'" if self.postgresql else f"JSON_VALUE({column}, '$.{key}')"

    def seconds(self, start: str, end: str) -> str:
        """``end - start`` in seconds, a float (NULL if either is)."""
        if self.postgresql:
            return f"EXTRACT(EPOCH FROM {end} - {start})::float"
        return f"TIMESTAMPDIFF(MICROSECOND, {start}, {end}) / 1e6"

    def now(self) -> str:
        """The database's current time, as Django stores times there (UTC)."""
        return "now()" if self.postgresql else "UTC_TIMESTAMP(6)"

    def epoch(self, moment: str) -> str:
        """A timestamp as a Unix time. Django keeps UTC in MariaDB's zone-less DATETIME, so it
        is counted from 1970 rather than given to UNIX_TIMESTAMP(), which would apply the
        session's time zone."""
        if self.postgresql:
            return f"EXTRACT(EPOCH FROM {moment})::float"
        return self.seconds("'1970-01-01'", moment)


#: Per ``connection.vendor`` of the private server.
DIALECTS = {"postgresql": Sql(postgresql=True), "mysql": Sql(postgresql=False)}


def demo_env(config: ChaosConfig, database: PrivateDatabase, redis_url: str = "") -> dict[str, str]:
    """The environment of every Django process of the run: the demo's variables, and nothing
    inherited that could point it at a shared service (``REDIS_URL`` is set, if empty)."""
    env = {
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "DATABASE_URL": database.url,
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": "",
        "DEBUG": "false",
        "DEMO_FAULTS": "true",
        "PYTHONPATH": str(ROOT),
    }
    if config.lease_seconds is not None:
        env["IDEMPOTENCY_LEASE_SECONDS"] = str(config.lease_seconds)
    if config.relay_lease_seconds is not None:
        env["IDEMPOTENCY_RELAY_LEASE_SECONDS"] = str(config.relay_lease_seconds)
    return env


class Run:
    """The processes of one chaos run and what they did; every process is ended by ``close``."""

    def __init__(self, config: ChaosConfig, database: PrivateDatabase, logs: Path) -> None:
        self.config = config
        self.database = database
        self.sql = DIALECTS[database.vendor]
        self.logs = logs
        self.prefix = f"chaos-{uuid.uuid4().hex[:6]}"
        self.accounts = [f"chaos_{n:02d}" for n in range(1, config.accounts + 1)]
        self.numbers = itertools.count(1)
        self.orders: list[Order] = []
        self.faults: list[Fault] = []
        self.client_errors: list[BaseException] = []
        self.relays: list[Child] = []
        self.relay_output: list[str] = []
        #: The relays the run itself killed; any other that is not alive at the end exited
        #: on its own, which no fault excuses.
        self.killed_relays: list[Child] = []
        self.exited_relays: list[str] = []
        self.undrained_tails: list[str] = []
        self.started = 0.0
        self.load_ended = 0.0
        self.drained_after: float | None = None

    def env(self, redis_url: str = "") -> dict[str, str]:
        return demo_env(self.config, self.database, redis_url)

    def seed(self) -> None:
        with self.database.connect() as connection:
            for name in self.accounts:
                connection.execute(
                    "INSERT INTO payments_account (name, balance, currency) VALUES (%s, %s, %s)",
                    [name, OPENING_BALANCE, CURRENCY],
                )

    # --- relays

    def start_relay(self) -> Child:
        args = [sys.executable, "-m", "django", "outbox_relay", "--loop"]
        relay = Child(args, self.env(), f"relay-{len(self.relays) + 1}")
        self.relays.append(relay)
        return relay

    def live_relays(self) -> list[Child]:
        return [relay for relay in self.relays if relay.alive()]

    def close(self) -> None:
        """Stop the relays, keeping their output; safe to call again."""
        for relay in self.relays:
            relay.terminate(timeout=10)
            self.relay_output.append(relay.output())
            (self.logs / f"{relay.name}.log").write_text(relay.output())
            relay.close()
        self.relays = []

    # --- phases

    def phase(self, index: int, redis: PrivateRedis | None) -> None:
        name = named(PHASES[index], self.database.label)
        env = self.env(redis.url if redis is not None else "")
        log = self.logs / f"gunicorn-{index + 1}.log"
        with demo_gunicorn(self.config.workers, log=log, **env) as server:
            # The phase's clock starts once a worker answers, not once gunicorn listens: beside
            # CI's other passes, workers took 20 s to import the project, and a fault planned
            # 4 s into the phase then struck a server that had served nothing yet.
            if not _wait(lambda: _answers(server.port), timeout=120, every=0.2):
                raise AssertionError(f"the demo's workers answered nothing within 120 s: {log}")
            start = time.time()
            self.started = self.started or start
            clients = Clients(
                port=server.port,
                phase=name,
                config=self.config,
                prefix=self.prefix,
                accounts=self.accounts,
                numbers=self.numbers,
                deadline=start + self.config.phase_seconds,
            )
            clients.start()
            try:
                for planned in self.config.schedule:
                    if planned.phase == index:
                        _sleep_until(start + planned.at * self.config.phase_seconds)
                        self.faults.append(self.strike(planned, name, server, redis))
            finally:
                clients.join()
                self.orders += clients.orders
                self.client_errors += clients.errors
        self.load_ended = time.time()

    def strike(
        self, planned: Planned, phase: str, server: Server, redis: PrivateRedis | None
    ) -> Fault:
        began = time.time()
        kind = named(planned.kind, self.database.label)
        postgresql = self.database.vendor == "postgresql"
        if planned.kind == WORKER:
            return self._kill_worker(phase, server)
        if planned.kind == DB_RESTART:
            back = self.database.restart()
            how = "fast shutdown and start" if postgresql else "SIGTERM and start"
            return Fault(phase, kind, began, back, how, True)
        if planned.kind == DB_DOWN:
            # PostgreSQL stops (a fast shutdown); MariaDB, whose clean stop is what its restart
            # does already, is SIGKILLed and recovers from its redo log when it starts.
            if postgresql:
                self.database.stop()
                how = f"stopped for {planned.down:g} s"
            else:
                self.database.crash()
                how = f"SIGKILL, started {planned.down:g} s later (crash recovery)"
            time.sleep(planned.down)
            back = self.database.start()
            return Fault(phase, kind, began, back, how, True)
        if planned.kind == REDIS:
            assert redis is not None, "Redis faults belong to the Redis phase"
            redis.kill()
            time.sleep(planned.down)
            redis.start()
            detail = f"SIGKILL, started empty {planned.down:g} s later"
            return Fault(phase, planned.kind, began, time.time(), detail)
        if planned.kind == RELAY:
            return self._kill_relay(phase)
        raise ValueError(f"unknown fault {planned.kind!r}")

    def _kill_worker(self, phase: str, server: Server) -> Fault:
        try:
            # A slow payment sleeps after publishing its event: its last statement is the
            # outbox INSERT, its transaction open.
            kill = kill_worker_mid_request(
                self.database, server, "%django_idempotency_outboxevent%", deadline=10
            )
            pid, began, detail = kill.pid, kill.at, "inside a payment's transaction"
        except AssertionError:
            pid, began = random.choice(server.worker_pids()), time.time()
            os.kill(pid, signal.SIGKILL)
            detail = "no request caught in its transaction: a random worker"
        replaced = _wait(
            lambda: len(pids := server.worker_pids()) >= self.config.workers and pid not in pids,
            timeout=30,
        )
        detail += "; replaced" if replaced else "; NOT replaced within 30 s"
        return Fault(phase, WORKER, began, time.time(), f"pid {pid} {detail}")

    def _claimed(self, delivered: bool = False) -> int:
        """Events claimed by a relay and not yet recorded as published; with ``delivered``,
        only those the ledger consumer has already handled."""
        query = (
            "SELECT count(*) FROM django_idempotency_outboxevent e "
            "WHERE e.status = 'PENDING' AND e.relay_token IS NOT NULL"
        )
        if delivered:
            query += (
                " AND EXISTS (SELECT 1 FROM django_idempotency_processedmessage m "
                f"WHERE m.message_id = {self.sql.text('e.event_id')})"
            )
        with contextlib.suppress(Exception), self.database.connect() as connection:
            row = connection.execute(query).fetchone()
            return int(row[0]) if row else 0
        return 0

    def _kill_relay(self, phase: str) -> Fault:
        # Best in the middle of a batch: some of its events delivered, none recorded as
        # published, so the next relay delivers them again once the dead one's lease ran out.
        if not _wait(lambda: self._claimed(delivered=True) > 0, timeout=5, every=0.01):
            _wait(lambda: self._claimed() > 0, timeout=3, every=0.01)
        claimed, delivered = self._claimed(), self._claimed(delivered=True)
        live = self.live_relays()
        if live:
            live[0].kill()
            self.killed_relays.append(live[0])
        killed_at = time.time()
        time.sleep(1)  # as a supervisor restarts a process
        successor = self.start_relay()
        up = _wait(lambda: RELAY_STARTED in successor.output(), timeout=60)
        detail = f"{claimed} events leased at the kill ({delivered} delivered); restarted" + (
            "" if up else " (slow)"
        )
        if not live:
            detail = "no relay was alive to kill; one started"
        return Fault(phase, RELAY, killed_at, time.time(), detail)

    def drain(self) -> None:
        """Wait for every event to be published (or DEAD), up to ``drain_seconds``."""

        def pending() -> int:
            with contextlib.suppress(Exception), self.database.connect() as connection:
                row = connection.execute(
                    "SELECT count(*) FROM django_idempotency_outboxevent WHERE status = 'PENDING'"
                ).fetchone()
                return int(row[0]) if row else 0
            return -1

        began = time.time()
        if _wait(lambda: pending() == 0, timeout=self.config.drain_seconds, every=0.5):
            self.drained_after = time.time() - began
        self.exited_relays = [
            relay.tail()
            for relay in self.relays
            if not relay.alive() and relay not in self.killed_relays
        ]
        if self.drained_after is None:
            # What the relays still running were doing, for the verdict to show.
            self.undrained_tails = [_last_lines(relay) for relay in self.live_relays()]


#: The lines of a traceback that say nothing of what happened.
TRACEBACK_LINES = (
    "Traceback (most recent call last):",
    "The above exception was the direct cause",
    "During handling of the above exception",
)


def _last_lines(relay: Child, count: int = 15) -> str:
    """A relay's last log lines and pass summaries, its tracebacks' frames left out."""
    lines = [
        line
        for line in relay.output().splitlines()
        if line and not line[0].isspace() and not line.startswith(TRACEBACK_LINES)
    ]
    return f"--- {relay.name} (pid {relay.pid}), its last lines ---\n" + "\n".join(lines[-count:])


# --- the verdict -------------------------------------------------------------------------------


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def _seconds(value: float | None, none: str = "n/a") -> str:
    return none if value is None else f"{value:.1f} s"


@dataclass
class Streak:
    key: str
    seconds: float
    tries: int
    after: str  # the kind of the last fault before it, or "no fault"
    fault_at: float | None


def _streaks(orders: list[Order], faults: list[Fault]) -> list[Streak]:
    """Per key, its longest run of 409 answers: from the first 409 try's start to the end of
    the try that broke the run (the client's backoff included)."""
    streaks = []
    for order in orders:
        longest: Streak | None = None
        run: list[Attempt] = []
        for attempt in [*order.attempts, None]:
            if attempt is not None and attempt.status == 409:
                run.append(attempt)
                continue
            if run:
                end = attempt.finished if attempt is not None else run[-1].finished
                seconds = end - run[0].started
                if longest is None or seconds > longest.seconds:
                    before = [f for f in faults if f.began <= run[0].started]
                    fault = before[-1] if before else None
                    longest = Streak(
                        order.key,
                        seconds,
                        len(run),
                        fault.kind if fault else "no fault",
                        fault.began if fault else None,
                    )
            run = []
        if longest is not None:
            streaks.append(longest)
    return streaks


@dataclass
class Report:
    """The run's figures; ``violations()`` are the guarantees it broke."""

    config: dict[str, Any]
    seconds: float
    figures: dict[str, Any]
    faults: list[dict[str, Any]]
    problems: list[str]

    def violations(self) -> list[str]:
        return self.problems

    def rows(self) -> list[tuple[str, str, str]]:
        f = self.figures
        late = f["publish_delay_s"]["late"]
        streak = f["longest_409_streak_s"]
        rows = [
            ("payments (logical) / requests", f"{f['payments']} / {f['requests']}", ""),
            ("answers: 2xx / 409 / 5xx / none", f["answers"], ""),
            ("faults injected", str(len(self.faults)), ""),
            ("duplicate effects", str(f["duplicate_effects"]), "0"),
            ("lost effects (2xx, no payment)", str(f["lost_effects"]), "0"),
            ("effects without a 2xx", str(f["effects_without_2xx"]), "0"),
            ("payments given up / not 201", f"{f['given_up']} / {f['not_201']}", "0 / 0"),
            ("balances exact (payments, ledger)", f["balances"], "all"),
            ("stuck keys (PROCESSING left)", str(f["stuck_keys"]), "0"),
            ("events published exactly once", f["events_once"], "all"),
            ("events not published at the end", str(f["events_unpublished"]), "0"),
            ("redeliveries absorbed by the inbox", str(f["inbox_duplicates_skipped"]), ""),
            ("longest 409 streak, any key", _seconds(streak, "none (no 409 at all)"), "≤ 6 s"),
        ]
        for template in KINDS:
            kind = named(template, self.config["database"])
            if kind in f["longest_409_streak_after"]:
                value = f["longest_409_streak_after"][kind]
                rows.append((f"  … after {kind}", _seconds(value), "≤ 6 s"))
        if "no fault" in f["longest_409_streak_after"]:
            value = f["longest_409_streak_after"]["no fault"]
            rows.append(("  … with no fault before it", _seconds(value), ""))
        rows += [
            ("keys that saw a 409", str(f["keys_with_409"]), ""),
            (
                "commit → publish max / p99 / p50",
                " / ".join(_seconds(f["publish_delay_s"][k]) for k in ("max", "p99", "p50")),
                "≤ 15 s",
            ),
            (f"events published > {LATE_SECONDS:g} s after commit", str(late), "0"),
            (
                "commit → publish max, per 10 s of commit time",
                " ".join("-" if w is None else f"{w:.0f}" for w in f["publish_delay_max_per_10_s"]),
                "",
            ),
            (
                "relay LISTEN lost / back (log lines)",
                # No LISTEN/NOTIFY outside PostgreSQL: the relay polls, and never logs either.
                f"{f['relay_listen_lost']} / {f['relay_listen_back']}"
                if self.config["database"] == "PostgreSQL"
                else "n/a (polls)",
                "",
            ),
            (
                "commit → ledger max / p99",
                " / ".join(_seconds(f["ledger_delay_s"][k]) for k in ("max", "p99")),
                "",
            ),
            ("outbox drained after the load", _seconds(f["drained_after_s"]), ""),
            ("5xx inside database-down windows", str(f["5xx_inside_db_down"]), ""),
            ("5xx outside database-down windows", str(f["5xx_outside_db_down"]), "0"),
        ]
        return rows

    def table(self) -> str:
        lines = [
            f"chaos run: {self.config['phase_seconds']:g} s of load per phase "
            f"({' then '.join(named(p, self.config['database']) for p in PHASES)}), "
            f"{self.config['clients']} clients, "
            f"{self.config['workers']} gunicorn workers, {self.config['relays']} relay; "
            f"{self.seconds:.0f} s in all",
            "",
            "| check | result | target |",
            "|---|---|---|",
            *(f"| {name} | {value} | {target} |" for name, value, target in self.rows()),
            "",
            "| t (s) | phase | fault | over after (s) | detail |",
            "|---:|---|---|---:|---|",
            *(
                f"| {fault['t']:.1f} | {fault['phase']} | {fault['kind']} | "
                f"{fault['over_after']:.1f} | {fault['detail']} |"
                for fault in self.faults
            ),
            "",
            "commit → publish runs from the event's created_at (written by publish() inside the "
            "payment's transaction) to its published_at.",
        ]
        if self.problems:
            lines += ["", f"VIOLATIONS ({len(self.problems)}):"]
            lines += [f"- {problem}" for problem in self.problems[:40]]
        else:
            lines += ["", "Every guarantee held."]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "seconds": self.seconds,
            "figures": self.figures,
            "faults": self.faults,
            "violations": self.problems,
            "table": [{"check": n, "result": v, "target": t} for n, v, t in self.rows()],
        }


def _verify(run: Run) -> Report:
    """Read back what the run left in the database and hold it against what the clients got."""
    orders, faults = run.orders, run.faults
    problems: list[str] = [f"client thread failed: {error!r}" for error in run.client_errors]
    problems += [f"a relay exited on its own:\n{tail}" for tail in run.exited_relays]
    if run.undrained_tails:
        problems.append(
            f"the outbox was not drained {run.config.drain_seconds:g} s after the load; the "
            "relays still running:\n" + "\n".join(run.undrained_tails)
        )
    sql = run.sql
    with run.database.connect() as connection:
        payments = connection.execute(
            f"SELECT {sql.text('p.transaction_id')}, p.amount, s.name, d.name "
            "FROM payments_payment p "
            "JOIN payments_account s ON s.id = p.source_account_id "
            "JOIN payments_account d ON d.id = p.destination_account_id"
        ).fetchall()
        balances = dict(connection.execute("SELECT name, balance FROM payments_account"))
        ledger_balances = dict(
            connection.execute(
                "SELECT a.name, sum(CASE l.side WHEN 'credit' THEN l.amount ELSE -l.amount END) "
                "FROM payments_ledgerentry l JOIN payments_account a ON a.id = l.account_id "
                "GROUP BY a.name"
            )
        )
        stuck = [
            key
            for (key,) in connection.execute(
                f"SELECT {sql.key} FROM django_idempotency_idempotencyrecord "
                f"WHERE {sql.key} LIKE %s AND status = 'PROCESSING'",
                [f"{run.prefix}-%"],
            )
        ]
        first_entry = (
            "(SELECT min(recorded_at) FROM payments_ledgerentry l WHERE l.event_id = e.event_id)"
        )
        events = connection.execute(
            f"SELECT {sql.text('e.event_id')}, {sql.json_text('e.payload', 'transaction_id')}, "
            f"e.status, {sql.seconds('e.created_at', 'e.published_at')}, "
            "(SELECT count(*) FROM payments_ledgerentry l WHERE l.event_id = e.event_id), "
            "(SELECT count(DISTINCT side) FROM payments_ledgerentry l "
            " WHERE l.event_id = e.event_id), "
            f"{sql.seconds('e.created_at', first_entry)}, "
            "(SELECT count(*) FROM django_idempotency_processedmessage m "
            f" WHERE m.consumer = %s AND m.message_id = {sql.text('e.event_id')}), "
            f"{sql.epoch('e.created_at')} "
            "FROM django_idempotency_outboxevent e WHERE e.topic = 'payment.completed'",
            [LEDGER],
        ).fetchall()
        # What holds back each event left unpublished: its attempts, its backoff and lease.
        held_back = connection.execute(
            f"SELECT {sql.text('event_id')}, status, attempts, "
            f"{sql.seconds(sql.now(), 'next_attempt_at')}, "
            f"{sql.seconds(sql.now(), 'locked_until')}, relay_token IS NOT NULL, last_error "
            "FROM django_idempotency_outboxevent WHERE status <> 'PUBLISHED' "
            "ORDER BY created_at LIMIT 20"
        ).fetchall()

    # Payments: found by their unique amount, one per paid order, none for the others.
    by_amount: dict[Decimal, list[tuple[str, str, str]]] = defaultdict(list)
    for transaction_id, amount, source, destination in payments:
        by_amount[Decimal(amount)].append((transaction_id, source, destination))
    duplicates = lost = without_2xx = 0
    for order in orders:
        found = by_amount.pop(order.amount, [])
        if len(found) > 1:
            duplicates += len(found) - 1
            problems.append(f"{order.key}: {len(found)} payments")
        if order.paid:
            answered = (order.answer or {}).get("transaction_id")
            if not any(tid == answered for tid, _, _ in found):
                lost += 1
                problems.append(f"{order.key}: answered {answered}, found {found}")
        elif found:
            without_2xx += 1
            problems.append(
                f"{order.key}: {len(found)} payment(s) but its answer was {order.final}"
            )
    unexplained = sum(len(rows) for rows in by_amount.values())
    if unexplained:
        problems.append(f"{unexplained} payments match no order of this run")

    # Balances: what the 2xx answers moved, and what the ledger recorded from the events.
    moved: dict[str, Decimal] = defaultdict(Decimal)
    for order in orders:
        if order.paid:
            moved[order.source] -= order.amount
            moved[order.destination] += order.amount
    wrong_balances = [
        name for name in run.accounts if balances[name] != OPENING_BALANCE + moved[name]
    ]
    wrong_ledger = [
        name for name in run.accounts if ledger_balances.get(name, Decimal(0)) != moved[name]
    ]
    for name in wrong_balances:
        expected = OPENING_BALANCE + moved[name]
        problems.append(f"{name}: balance {balances[name]}, expected {expected}")
    for name in wrong_ledger:
        problems.append(f"{name}: ledger says {ledger_balances.get(name)}, expected {moved[name]}")
    problems += [f"{key}: left PROCESSING" for key in stuck]

    # Events: one per payment, published, consumed once (one debit, one credit, one marker).
    paid_ids = {tid for tid, *_ in payments}
    event_of: Counter[str] = Counter(transaction_id for _, transaction_id, *_ in events)
    unpublished = [event for event in events if event[2] != "PUBLISHED"]
    not_once = [event for event in events if (event[4], event[5], event[7]) != (2, 2, 1)]
    missing_events = [tid for tid in paid_ids if event_of[tid] != 1]
    problems += [
        f"event {event_id}: {status} after {attempts} attempts, next attempt "
        + ("due" if next_in is None or next_in <= 0 else f"in {_seconds(next_in)}")
        + (f", leased for {_seconds(lease_in)} more" if leased else ", not leased")
        + f", last error {(error or '')[:200]!r}"
        for event_id, status, attempts, next_in, lease_in, leased, error in held_back
    ]
    if len(unpublished) > len(held_back):
        problems.append(f"{len(unpublished) - len(held_back)} more events unpublished")
    problems += [
        f"event {e[0]}: {e[4]} ledger entries ({e[5]} sides), {e[7]} markers" for e in not_once
    ]
    problems += [f"payment {tid}: {event_of[tid]} events" for tid in missing_events]
    publish_delays = [e[3] for e in events if e[3] is not None]
    ledger_delays = [e[6] for e in events if e[6] is not None]
    # The longest wait of the events written in each 10 s of the run, to read beside the
    # timeline: which fault held events back is not recorded anywhere (a lease left by a killed
    # relay holds back every later event of its keys, through the faults that follow).
    waits: dict[int, float] = {}
    for event in events:
        if event[3] is not None:
            bucket = int((event[8] - run.started) // 10)
            waits[bucket] = max(waits.get(bucket, 0.0), event[3])

    # Answers: 5xx only while the database was down; a 409 streak after each kind of fault.
    attempts = [attempt for order in orders for attempt in order.attempts]
    windows = [(fault.began, fault.ended) for fault in faults if fault.database_down]
    server_errors = [a for a in attempts if a.status is not None and a.status >= 500]
    outside = [
        a
        for a in server_errors
        if not any(a.started <= end and a.finished >= begin for begin, end in windows)
    ]
    problems += [
        f"{a.status} at t={a.started - run.started:.1f} s, outside every database-down window"
        for a in outside
    ]
    given_up = [order for order in orders if order.final is None]
    not_201 = [order for order in orders if order.final is not None and order.final != 201]
    problems += [f"{o.key}: given up after {len(o.attempts)} tries" for o in given_up]
    problems += [f"{o.key}: answered {o.final} {o.answer}" for o in not_201]
    streaks = _streaks(orders, faults)
    longest_after: dict[str, float] = {}
    for streak in streaks:
        longest_after[streak.after] = max(longest_after.get(streak.after, 0.0), streak.seconds)
    statuses = Counter(a.status for a in attempts)
    relay_output = "".join(run.relay_output)

    figures = {
        "payments": len(orders),
        "payments_by_phase": dict(Counter(order.phase for order in orders)),
        "requests": len(attempts),
        "answers": " / ".join(
            str(n)
            for n in (
                sum(v for k, v in statuses.items() if k is not None and 200 <= k < 300),
                statuses.get(409, 0),
                len(server_errors),
                statuses.get(None, 0),
            )
        ),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "duplicate_effects": duplicates,
        "lost_effects": lost,
        "effects_without_2xx": without_2xx,
        "unexplained_payments": unexplained,
        "given_up": len(given_up),
        "not_201": len(not_201),
        "balances": (
            f"{len(run.accounts) - len(wrong_balances)}/{len(run.accounts)}, "
            f"{len(run.accounts) - len(wrong_ledger)}/{len(run.accounts)}"
        ),
        "stuck_keys": len(stuck),
        "events": len(events),
        "events_once": f"{len(events) - len(not_once)}/{len(paid_ids)}",
        "events_unpublished": len(unpublished),
        "inbox_duplicates_skipped": relay_output.count(DUPLICATE_SKIPPED),
        "keys_with_409": len(streaks),
        "longest_409_streak_s": max((s.seconds for s in streaks), default=None),
        "longest_409_streak_after": longest_after,
        "longest_409_streaks": [asdict(s) for s in sorted(streaks, key=lambda s: -s.seconds)[:5]],
        "publish_delay_s": {
            "max": max(publish_delays, default=None),
            "p99": _percentile(publish_delays, 0.99),
            "p50": _percentile(publish_delays, 0.50),
            "late": sum(d > LATE_SECONDS for d in publish_delays),
        },
        "publish_delay_max_per_10_s": [waits.get(n) for n in range(max(waits, default=-1) + 1)],
        "relay_listen_lost": relay_output.count(LISTEN_LOST),
        "relay_listen_back": relay_output.count(LISTEN_BACK),
        "ledger_delay_s": {
            "max": max(ledger_delays, default=None),
            "p99": _percentile(ledger_delays, 0.99),
        },
        "drained_after_s": run.drained_after,
        "5xx_inside_db_down": len(server_errors) - len(outside),
        "5xx_outside_db_down": len(outside),
    }
    config = {
        "database": run.database.label,
        **{k: v for k, v in asdict(run.config).items() if k not in ("schedule", "logs")},
        "logs": str(run.logs),
    }
    timeline = [
        {
            "t": fault.began - run.started,
            "phase": fault.phase,
            "kind": fault.kind,
            "over_after": fault.ended - fault.began,
            "detail": fault.detail,
            "database_down": fault.database_down,
        }
        for fault in faults
    ]
    return Report(config, time.time() - run.started, figures, timeline, problems)


#: What each database's run needs installed, and the packages that bring it.
TOOLS = {
    "postgresql": (("pg_createcluster", "postgresql-common"), ("redis-server", "redis-server")),
    "mariadb": (
        (MARIADBD, "mariadb-server"),
        ("mariadb-install-db", "mariadb-server"),
        ("redis-server", "redis-server"),
    ),
}


def missing_tools(database: str) -> list[str]:
    """The tools a run on ``database`` needs that are not installed, with their packages."""
    return [f"{tool} ({package})" for tool, package in TOOLS[database] if not shutil.which(tool)]


def _keep_log(log: Path, keep: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.copyfile(log, keep)


def run(config: ChaosConfig, database: str = "postgresql") -> Report:
    """One chaos run on ``database`` (``postgresql`` or ``mariadb``) from nothing to its report;
    every process and server it started is gone when it returns, whatever happened."""
    if missing := missing_tools(database):
        raise RuntimeError(f"the chaos run on {database} needs {', '.join(missing)}")
    config.logs.mkdir(parents=True, exist_ok=True)
    for old in config.logs.glob("*.log"):
        old.unlink()
    kill_stale_redis()

    def server_env(server: PrivateDatabase) -> dict[str, str]:
        return demo_env(config, server)

    private_server: Callable[..., AbstractContextManager[PrivateDatabase]] = (
        private_postgres_cluster if database == "postgresql" else private_mariadb_server
    )
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(private_server("chaos", server_env=server_env))
        # Runs before the server and its log are removed (an ExitStack unwinds last in, first out).
        stack.callback(_keep_log, server.log, config.logs / "database.log")
        chaos = Run(config, server, config.logs)
        chaos.seed()
        stack.callback(chaos.close)
        for _ in range(config.relays):
            chaos.start_relay()
        for relay in chaos.relays:
            if not _wait(lambda relay=relay: RELAY_STARTED in relay.output(), timeout=60):
                raise RuntimeError(f"the relay did not start:\n{relay.tail()}")
        chaos.phase(0, None)
        redis = PrivateRedis(free_port(), Path(tempfile.mkdtemp(prefix="chaos-redis-")))
        stack.callback(redis.close)
        redis.start()
        chaos.phase(1, redis)
        chaos.drain()
        chaos.close()
        return _verify(chaos)
    raise AssertionError("unreachable")  # pragma: no cover (ExitStack does not swallow)


def _beside(path: Path, database: str) -> Path:
    """Where a database other than PostgreSQL puts its report or logs: ``chaos-mariadb.json``
    beside ``chaos.json``, so that a run of both keeps both."""
    if database == "postgresql":
        return path
    return path.with_name(f"{path.stem}-{database}{path.suffix}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="The CI version (about a minute).")
    parser.add_argument(
        "--database",
        choices=[*DATABASES, "all"],
        default="postgresql",
        help="The private server the demo runs on; all: one run on each, one table each.",
    )
    parser.add_argument("--phase-seconds", type=float, help="Seconds of load per phase.")
    parser.add_argument("--clients", type=int, help="Client threads.")
    parser.add_argument(
        "--json",
        type=Path,
        default=ROOT / "artifacts" / "chaos.json",
        help="Report file (PostgreSQL's; another database's gets its name: chaos-mariadb.json).",
    )
    options = parser.parse_args(argv)
    config = ChaosConfig.short() if options.short else ChaosConfig()
    if options.phase_seconds:
        config = replace(config, phase_seconds=options.phase_seconds)
    if options.clients:
        config = replace(config, clients=options.clients)
    databases = list(DATABASES) if options.database == "all" else [options.database]
    failed = False
    for database in databases:
        logs = _beside(config.logs, database)
        report = run(replace(config, logs=logs), database)
        print(report.table())
        path = _beside(options.json, database)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.as_json(), indent=2, default=str) + "\n")
        print(f"\nwritten to {path}; logs in {logs}\n")
        failed = failed or bool(report.violations())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
