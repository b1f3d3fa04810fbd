"""HTTP benchmark: two DRF create endpoints under gunicorn on PostgreSQL, driven by wrk.

The demo's payment POST (the heavier endpoint) and the lightest create there is (a three-field
note), each plain, guarded by ours and by the peers; and the same server's bare GET, the ceiling
a replay can reach, with a bare POST beside it (a note replay's request answered by a view that
does nothing: the part of a replay's cost that is the request's own), and three floors (what any
idempotency layer must do at the least, done by a view with no layer's code: ``FLOORS``). Every
variant runs in its own gunicorn (see ``benchproject/settings.py``); rows are measured in
interleaved rounds and reported as medians, with each row's throughput and CPU per request
relative to the plain endpoint, replays also relative to the ceiling. Per request it reports the
workers' CPU, the PostgreSQL backends' CPU, the SQL statements the workers ran and the commits
the database counted. ``--smoke`` runs a few requests per row and fails on any error.

    python -m benchmarks.run [--rounds 3] [--duration 6] [--smoke]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.benchproject import counting

ROOT = Path(__file__).resolve().parent.parent
LUA = Path(__file__).resolve().parent / "request.lua"
#: Payments move between these many accounts, so requests do not all queue on the same two
#: rows; each request's pair is fixed by its key (request.lua does the same), which keeps a
#: replayed request's body identical to the original's.
ACCOUNTS = 200


def body_for(number: int) -> str:
    source = number % ACCOUNTS + 1
    destination = (number + 1) % ACCOUNTS + 1
    return json.dumps(
        {"amount": "1.00", "currency": "USD", "source_account": f"acc_{source}",
         "destination_account": f"acc_{destination}"},
        separators=(", ", ": "),
    )  # fmt: skip


BODY = body_for(0)
NOTE_BODY = json.dumps({"title": "bench", "body": "a note", "done": False}, separators=(", ", ": "))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    variant: str
    port: int
    process: subprocess.Popen[bytes] | None = None
    #: Replay keys per endpoint, created before the rounds (a key belongs to one path).
    replay_prefixes: dict[str, str] = field(default_factory=dict)

    def replay_prefix(self, endpoint: Endpoint) -> str:
        return self.replay_prefixes.setdefault(endpoint.name, secrets.token_hex(4))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_pids(self) -> list[int]:
        assert self.process is not None
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()]

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(pid) for pid in self.worker_pids())


@dataclass(frozen=True)
class Endpoint:
    name: str
    guarded: str  # the path ours and the peers guard
    plain: str  # the same view without idempotency
    body: str  # request.lua's BENCH_BODY


@dataclass(frozen=True)
class Row:
    label: str
    server: str
    endpoint: Endpoint | None  # None: the bare GET
    mode: str  # first | replay | none | get
    group: str  # rows that do the same work share a group, for "ahead of every peer"
    #: The endpoint whose plain row "× plain" compares with (None: this row's own endpoint).
    baseline: Endpoint | None = None

    @property
    def path(self) -> str:
        if self.endpoint is None:
            return "/get/"
        return self.endpoint.plain if self.mode == "none" else self.endpoint.guarded


PAYMENTS = Endpoint("payments", "/api/v1/payments/", "/plain/payments/", "payment")
NOTES = Endpoint("notes", "/api/v1/notes/", "/plain/notes/", "note")
#: What guards the endpoint, and the storage it keeps keys in ("first-db" groups with "first-db").
GUARDS = [
    ("ours", "ours", "database"),
    ("ours", "ours-redis", "Redis"),
    # The same Redis copy behind IdempotencyMiddleware: a replay answered before DRF runs.
    ("ours, middleware", "ours-middleware", "Redis"),
    ("drf-idempotency", "drfi-db", "database"),
    ("drf-idempotency", "drfi-redis", "Redis"),
    ("django-idempotency-key", "dik", "Redis"),
    ("drf-idempotencykey", "drfik", "database"),
]


def endpoint_rows(endpoint: Endpoint) -> list[Row]:
    rows = [Row(f"{endpoint.name}: plain, no idempotency", "ours", endpoint, "none", "plain")]
    for name, server, storage in GUARDS:
        group = "db" if storage == "database" else "redis"
        for mode, what in (("first", "first-time"), ("replay", "replays")):
            label = f"{endpoint.name}: {name}, {what}, {storage}"
            rows.append(Row(label, server, endpoint, mode, f"{mode}-{group}"))
    # Replays answered from each worker's memory (LOCAL_REPLAY_SECONDS): no peer keeps answers
    # there, so the row has a group of its own; its first-time path is the database row's.
    label = f"{endpoint.name}: ours, replays, kept in memory (database behind)"
    rows.append(Row(label, "ours-memory", endpoint, "replay", "replay-memory"))
    return rows


CEILING = Row("bare GET (ceiling)", "ours", None, "get", "ceiling")
#: A note replay's request (its headers and body) answered by a view that does nothing with it:
#: what that request costs the server and the client before any idempotency work, beside the GET.
BARE_POST = Row(
    "bare POST (a note replay's request, nothing done)",
    "ours",
    Endpoint("bare POST", "/post/", "/post/", "note"),
    "replay",
    "ceiling-post",
)
#: What any idempotency layer must do at the least, done by a view with no layer's code
#: (``benchproject.views``): no layer can pass its floor on the same machine.
REDIS_FLOOR = Row(
    "floor: bare POST + one Redis GET (a replay from Redis)",
    "ours",
    Endpoint("Redis floor", "/floor/redis/", "/floor/redis/", "note"),
    "replay",
    "floor-redis",
)
DATABASE_FLOOR = Row(
    "floor: bare POST + one indexed SELECT (a replay from the database)",
    "ours",
    Endpoint("database floor", "/floor/database/", "/floor/database/", "note"),
    "replay",
    "floor-db",
)
FIRST_TIME_FLOOR = Row(
    "floor: notes plain + a claim committed before it, completed in it (first-time)",
    "ours",
    Endpoint("first-time floor", "/floor/notes/", "/floor/notes/", "note"),
    "first",
    "floor-first",
    baseline=NOTES,
)
# A layer inside DRF's view (a mixin) knows the caller, its keys' scope, only after DRF's
# request and authentication: these two floors pay for those, and for nothing else of DRF's.
DRF_REDIS_FLOOR = Row(
    "floor: DRF authentication + one Redis GET (a replay from Redis, inside DRF)",
    "ours",
    Endpoint("DRF Redis floor", "/floor/drf/redis/", "/floor/drf/redis/", "note"),
    "replay",
    "floor-drf-redis",
)
DRF_DATABASE_FLOOR = Row(
    "floor: DRF authentication + one indexed SELECT (a replay from the database, inside DRF)",
    "ours",
    Endpoint("DRF database floor", "/floor/drf/database/", "/floor/drf/database/", "note"),
    "replay",
    "floor-drf-db",
)
FLOORS = [REDIS_FLOOR, DATABASE_FLOOR, FIRST_TIME_FLOOR, DRF_REDIS_FLOOR, DRF_DATABASE_FLOOR]
ROWS = [*endpoint_rows(PAYMENTS), *endpoint_rows(NOTES), CEILING, BARE_POST, *FLOORS]
#: Groups compared with the ceiling ("× ceiling").
AGAINST_CEILING = ("ceiling-post", "floor-redis", "floor-db", "floor-drf-redis", "floor-drf-db")
#: Groups that are a baseline themselves: no added latency to report.
BASELINES = ("plain", "ceiling", "ceiling-post", *AGAINST_CEILING[1:])
#: Our notes rows (by label) and the floors each is held to ("ours / floor"): the layer's own
#: distance from the least its guarantee costs, which the host's speed moves far less than
#: "× ceiling".
AGAINST_FLOORS: dict[str, tuple[Row, ...]] = {
    "notes: ours, replays, database": (DATABASE_FLOOR, DRF_DATABASE_FLOOR),
    "notes: ours, replays, Redis": (REDIS_FLOOR, DRF_REDIS_FLOOR),
    "notes: ours, middleware, replays, Redis": (REDIS_FLOOR,),
    "notes: ours, first-time, database": (FIRST_TIME_FLOOR,),
    "notes: ours, first-time, Redis": (FIRST_TIME_FLOOR,),
    "notes: ours, middleware, first-time, Redis": (FIRST_TIME_FLOOR,),
}
if not set(AGAINST_FLOORS) <= {row.label for row in ROWS}:  # a renamed row, caught at import
    raise RuntimeError(f"AGAINST_FLOORS names rows that do not exist: {set(AGAINST_FLOORS)}")


def measuring_order() -> list[Row]:
    """The rows in the order a round measures them: each floor right after the first of our
    rows held to it, so that a row and its floor run seconds apart, not minutes (this host's
    speed drifts within a round). Rotated each round, which keeps them next to each other."""
    order: list[Row] = []
    for row in ROWS:
        if row not in FLOORS:
            order.append(row)
            order += [floor for floor in AGAINST_FLOORS.get(row.label, ()) if floor not in order]
    return order + [floor for floor in FLOORS if floor not in order]


VARIANTS = [
    "ours", "ours-redis", "ours-memory", "ours-middleware", "drfi-db", "drfi-redis", "dik", "drfik"
]  # fmt: skip
#: The ``Authorization`` header each variant's clients send (none where absent): the middleware
#: scopes keys by it, since it answers replays before DRF's authentication runs.
AUTHORIZATION = {"ours-middleware": "Token bench-client"}


def environment(variant: str, args: argparse.Namespace) -> dict[str, str]:
    return {
        **os.environ,
        "BENCH_VARIANT": variant,
        "BENCH_DATABASE_URL": args.database_url,
        "BENCH_REDIS_URL": args.redis_url,
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
        "PYTHONPATH": str(ROOT),
    }


def django(args: argparse.Namespace, code: str) -> None:
    subprocess.run(
        [sys.executable, "-c", f"import django; django.setup()\n{code}"],
        env=environment("all", args),
        cwd=ROOT,
        check=True,
    )


def prepare_database(args: argparse.Namespace) -> None:
    """Create the database if needed, migrate every app, start from empty tables."""
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        env=environment("all", args),
        cwd=ROOT,
        check=True,
    )
    django(
        args,
        "from django.apps import apps\n"
        "from django.contrib.auth import get_user_model\n"
        "from demo_project.payments.models import Account\n"
        "for config in apps.get_app_configs():\n"
        "    if config.label in ('django_idempotency', 'idempotency_key', 'drf_idempotency',"
        " 'drf_idempotencykey', 'payments', 'bench_notes'):\n"
        "        for model in config.get_models():\n"
        "            if model is not Account:\n"
        "                model.objects.all().delete()\n"
        "get_user_model().objects.get_or_create(username='bench')\n"
        f"for number in range(1, {ACCOUNTS} + 1):\n"
        "    Account.objects.get_or_create(name=f'acc_{number}', defaults={'balance': 10**9})\n",
    )


def create_database(args: argparse.Namespace) -> None:
    """CREATE DATABASE when it does not exist yet (PostgreSQL)."""
    import psycopg

    name = args.database_url.rsplit("/", 1)[1]
    admin_url = args.database_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def start(server: Server, args: argparse.Namespace) -> None:
    server.process = subprocess.Popen(
        [
            sys.executable, "-m", "gunicorn", "benchmarks.benchproject.wsgi:application",
            "--workers", str(args.workers), "--bind", f"127.0.0.1:{server.port}",
            "--log-level", "warning", "--backlog", "2048",
        ],
        env=environment(server.variant, args),
        cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip


def wait_until_up(server: Server) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(server.base + "/get/", timeout=2):
                return
        except OSError:  # refused, reset, or not answering yet
            time.sleep(0.2)
    raise RuntimeError(f"{server.variant} server did not start")


def stop(server: Server) -> None:
    if server.process is not None and server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(30)


def post(
    url: str, key: str | None, body: str = BODY, authorization: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if authorization is not None:
        headers["Authorization"] = authorization
    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def replay_key(server: Server, endpoint: Endpoint, number: int) -> str:
    return f"{server.replay_prefix(endpoint)}-0000-4000-8000-{number:012x}"


def create_replay_keys(server: Server, endpoint: Endpoint, count: int) -> None:
    for number in range(count):
        key = replay_key(server, endpoint, number)
        body = body_for(number) if endpoint is PAYMENTS else NOTE_BODY
        authorization = AUTHORIZATION.get(server.variant)
        status, _, answer = post(server.base + endpoint.guarded, key, body, authorization)
        if status != 201:
            raise RuntimeError(f"{server.variant}: creating a replay key got {status}: {answer!r}")


def duplicates_let_through(server: Server, attempts: int = 8) -> int:
    """Fire one new key from several clients at once; count the payments it created."""
    key = f"{secrets.token_hex(4)}-ffff-4000-8000-000000000000"
    url = server.base + "/api/v1/payments/"
    with concurrent.futures.ThreadPoolExecutor(attempts) as pool:
        authorization = AUTHORIZATION.get(server.variant)
        results = list(pool.map(lambda _: post(url, key, BODY, authorization), range(attempts)))
    created = {json.loads(body)["transaction_id"] for status, _, body in results if status == 201}
    return len(created)


@dataclass(frozen=True)
class Snapshot:
    """Counters read between rows; a row's figures are the differences over its requests."""

    app_cpu: float  # the row's server's gunicorn workers, seconds
    statements: int  # SQL statements those workers executed (benchproject/counting.py)
    postgres_cpu: dict[int, float]  # per backend serving the benchmark database, seconds


class Database:
    """Reads the benchmark database's counters, over a connection to another database.

    PostgreSQL CPU is the ``/proc`` CPU time of the backends serving the benchmark database (the
    workers' connections; the WAL writer and the checkpointer, shared with other databases, are
    left out). Commits come from ``pg_stat_database``, which a busy backend updates at most once
    a second and an idle one only 10 s after its last report, so they are counted in a pass of
    their own that waits :data:`STATS_DELAY` after each row (:func:`count_commits`).
    """

    STATS_DELAY = 10.5

    def __init__(self, database_url: str) -> None:
        self.name = database_url.rsplit("/", 1)[1]
        self.connection = psycopg.connect(
            database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True
        )

    def backends_cpu(self) -> dict[int, float]:
        pids = self.connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", [self.name]
        ).fetchall()
        cpu = {}
        for (pid,) in pids:
            # A backend gone, or a server in another PID namespace: no CPU to read.
            with contextlib.suppress(FileNotFoundError):
                cpu[pid] = process_cpu_seconds(pid)
        return cpu

    def commits(self) -> int:
        row = self.connection.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [self.name]
        ).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.connection.close()


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def snapshot(server: Server, database: Database, count_dir: Path) -> Snapshot:
    return Snapshot(
        app_cpu=server.cpu_seconds(),
        statements=counting.total(count_dir, server.variant),
        postgres_cpu=database.backends_cpu(),
    )


def wrk(
    server: Server,
    row: Row,
    args: argparse.Namespace,
    duration: float,
    measure: tuple[Database, Path] | None = None,
) -> dict[str, Any]:
    env = {
        **os.environ,
        "BENCH_MODE": row.mode,
        "BENCH_BODY": row.endpoint.body if row.endpoint else "none",
        "BENCH_KEY_PREFIX": secrets.token_hex(4),
        "BENCH_REPLAY_KEYS": str(args.replay_keys),
        "BENCH_ACCOUNTS": str(ACCOUNTS),
        "BENCH_AUTHORIZATION": AUTHORIZATION.get(server.variant, ""),
    }
    if row.mode == "replay" and row.endpoint is not None:
        env["BENCH_KEY_PREFIX"] = server.replay_prefix(row.endpoint)
    before = snapshot(server, *measure) if measure else None
    output = subprocess.run(
        [
            "wrk", "--threads", str(args.threads), "--connections", str(args.connections),
            "--duration", f"{duration:.0f}s", "--timeout", "10s", "--script", str(LUA),
            server.base + row.path,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # fmt: skip
    line = next(line for line in output.splitlines() if line.startswith("WRK_RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("WRK_RESULT "))
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    if measure and before:
        after = snapshot(server, *measure)
        requests = max(result["requests"], 1)
        postgres_cpu = sum(
            cpu - before.postgres_cpu.get(pid, 0.0) for pid, cpu in after.postgres_cpu.items()
        )
        result["cpu_ms_per_request"] = 1000 * (after.app_cpu - before.app_cpu) / requests
        result["pg_cpu_ms_per_request"] = 1000 * postgres_cpu / requests
        result["statements_per_request"] = (after.statements - before.statements) / requests
    return result


def count_commits(
    servers: dict[str, Server], database: Database, args: argparse.Namespace
) -> dict[str, float]:
    """Commits per request of each row, from ``pg_stat_database``, one row at a time.

    Each row runs alone for ``--commit-seconds``, then the backends are left idle until they have
    reported their counts; the benchmark database sees nothing else meanwhile.
    """
    time.sleep(Database.STATS_DELAY)
    commits = {}
    for row in ROWS:
        before = database.commits()
        result = wrk(servers[row.server], row, args, args.commit_seconds)
        time.sleep(Database.STATS_DELAY)
        commits[row.label] = (database.commits() - before) / max(result["requests"], 1)
        print(f"commits: {row.label}: {commits[row.label]:.2f}/request", file=sys.stderr)
    return commits


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def summarise(
    results: dict[str, list[dict[str, Any]]], commits: dict[str, float]
) -> list[dict[str, Any]]:
    """Medians per row; ratios to the same endpoint's plain row, replays also to the ceiling."""

    def median(row: Row, name: str) -> float:
        return statistics.median(result[name] for result in results[row.label])

    plain = {row.endpoint: row for row in ROWS if row.mode == "none"}
    ceiling_rps = median(CEILING, "rps")
    summary = []
    for row in ROWS:
        base = plain.get(row.baseline or row.endpoint, plain[PAYMENTS])
        cpu = median(row, "cpu_ms_per_request") + median(row, "pg_cpu_ms_per_request")
        base_cpu = median(base, "cpu_ms_per_request") + median(base, "pg_cpu_ms_per_request")
        summary.append(
            {
                "row": row.label,
                "group": row.group,
                "endpoint": row.endpoint.name if row.endpoint else None,
                "rps": median(row, "rps"),
                "ratio": median(row, "rps") / median(base, "rps"),
                "ceiling_ratio": median(row, "rps") / ceiling_rps,
                "p50_ms": median(row, "p50_us") / 1000,
                "p99_ms": median(row, "p99_us") / 1000,
                "p99_added_ms": (median(row, "p99_us") - median(base, "p99_us")) / 1000,
                "cpu_ms": median(row, "cpu_ms_per_request"),
                "pg_cpu_ms": median(row, "pg_cpu_ms_per_request"),
                "cpu_ratio": cpu / base_cpu if base_cpu else float("nan"),
                "statements": median(row, "statements_per_request"),
                "commits": commits.get(row.label),
            }
        )
    return summary


def against_floors(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each of our notes rows over each of its floors, round by round (the two measured seconds
    apart, ``measuring_order``), and the median of those ratios: steadier than the ratio of
    the two rows' medians, which may come from different rounds."""
    compared = []
    for label, floors in AGAINST_FLOORS.items():
        for floor in floors:
            rounds = [
                ours["rps"] / base["rps"]
                for ours, base in zip(results[label], results[floor.label], strict=True)
                if base["rps"]
            ]
            if rounds:
                compared.append(
                    {
                        "row": label,
                        "floor": floor.label,
                        "rounds": rounds,
                        "median": statistics.median(rounds),
                    }
                )
    return compared


def floors_table(compared: list[dict[str, Any]]) -> str:
    lines = [
        "| our row | floor | ours / floor, median of rounds | rounds |",
        "|---|---|---:|---|",
    ]
    for item in compared:
        rounds = ", ".join(f"{ratio:.2f}" for ratio in item["rounds"])
        floor = item["floor"].removeprefix("floor: ")
        lines.append(f"| {item['row']} | {floor} | {item['median']:.2f} | {rounds} |")
    return "\n".join(lines)


def table(summary: list[dict[str, Any]], duplicates: dict[str, int]) -> str:
    lines = [
        "| row | req/s | × plain | × ceiling | p50 ms | p99 ms | p99 added ms | app CPU ms/req "
        "| PG CPU ms/req | × plain CPU | SQL/req | commits/req |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for item in summary:
        against_ceiling = item["group"].startswith("replay") or item["group"] in AGAINST_CEILING
        ceiling = f"{item['ceiling_ratio']:.2f}" if against_ceiling else ""
        baseline = item["group"] in BASELINES
        added = "" if baseline else f"{item['p99_added_ms']:+.1f}"
        lines.append(
            f"| {item['row']} | {item['rps']:.0f} | {item['ratio']:.2f} | {ceiling} "
            f"| {item['p50_ms']:.1f} | {item['p99_ms']:.1f} | {added} | {item['cpu_ms']:.2f} "
            f"| {item['pg_cpu_ms']:.2f} | {item['cpu_ratio']:.2f} | {item['statements']:.1f} "
            f"| {'–' if item['commits'] is None else format(item['commits'], '.2f')} |"
        )
    lines += ["", "Payments created by 8 concurrent requests with one new key (1 is correct):", ""]
    lines += [f"- {variant}: {count}" for variant, count in duplicates.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per row and round")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers per server")
    parser.add_argument("--replay-keys", type=int, default=100)
    parser.add_argument(
        "--commit-seconds", type=float, default=2.0, help="seconds per row of the commit count"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a few requests per row; fail on errors"
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/idem_speed_bench"
        ),
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/2")
    )
    parser.add_argument("--output", type=Path, default=ROOT / "artifacts" / "bench.json")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.duration, args.connections, args.replay_keys = 1, 1.0, 2, 5
    if shutil.which("wrk") is None:
        print("wrk is not installed: apt-get install -y wrk", file=sys.stderr)
        return 2

    create_database(args)
    prepare_database(args)
    count_dir = Path(tempfile.mkdtemp(prefix="bench-statements-"))
    os.environ["BENCH_COUNT_DIR"] = str(count_dir)
    database = Database(args.database_url)
    servers = {variant: Server(variant, 8301 + index) for index, variant in enumerate(VARIANTS)}
    load_before = os.getloadavg()
    try:
        for server in servers.values():
            start(server, args)
        for server in servers.values():
            wait_until_up(server)
            print(f"{server.variant}: up; creating replay keys", file=sys.stderr)
            for endpoint in (PAYMENTS, NOTES):
                create_replay_keys(server, endpoint, args.replay_keys)
        for variant in ("ours", "ours-middleware"):
            # The replay rows must replay: a key sent under another scope would run again.
            server = servers[variant]
            smoke_replay = post(
                server.base + PAYMENTS.guarded,
                replay_key(server, PAYMENTS, 0),
                authorization=AUTHORIZATION.get(variant),
            )
            if smoke_replay[1].get("Idempotent-Replay") != "true":
                raise RuntimeError(f"{variant}: our replay was not a replay: {smoke_replay}")
        duplicates = {}
        for variant, server in servers.items():
            print(f"{variant}: concurrent duplicates", file=sys.stderr)
            duplicates[variant] = duplicates_let_through(server)
        if not args.smoke:  # warm every server and the database caches
            for row in ROWS:
                wrk(servers[row.server], row, args, 2.0)
        results: dict[str, list[dict[str, Any]]] = {row.label: [] for row in ROWS}
        for round_number in range(args.rounds):
            # Rotate the order each round, so no row always runs first or last.
            order = measuring_order()
            shift = round_number % len(order)
            for row in order[shift:] + order[:shift]:
                result = wrk(servers[row.server], row, args, args.duration, (database, count_dir))
                results[row.label].append(result)
                print(f"round {round_number + 1}/{args.rounds}: {row.label}: "
                      f"{result['rps']:.0f} req/s", file=sys.stderr)  # fmt: skip
        commits = {} if args.smoke else count_commits(servers, database, args)
    finally:
        for server in servers.values():
            stop(server)
        database.close()
        shutil.rmtree(count_dir, ignore_errors=True)
    summary = summarise(results, commits)
    compared = against_floors(results)
    report = {
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"}
        | {"body": BODY, "note_body": NOTE_BODY},
        "summary": summary,
        "against_floors": compared,
        "duplicates": duplicates,
        "raw": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(table(summary, duplicates))
    print("\nOur rows against their floors, each round's pair measured seconds apart:\n")
    print(floors_table(compared))
    print(f"\nmachine: {report['machine']}; load average before {load_before}, "
          f"after {report['load_average_after']}; raw results in {args.output}")  # fmt: skip
    if args.smoke:
        failed = [
            label
            for label, runs in results.items()
            if any(r["requests"] == 0 or r["bad_status"] or r["socket_errors"] for r in runs)
        ]
        if failed:
            print(f"smoke run failed for: {failed}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
