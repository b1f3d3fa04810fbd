"""HTTP benchmark: the demo's payment POST under gunicorn on PostgreSQL, driven by wrk.

Every variant runs in its own gunicorn (see ``benchproject/settings.py``); rows are measured in
interleaved rounds and reported as medians, with each row's throughput and CPU per request
relative to the plain endpoint. ``--smoke`` runs a few requests per row and fails on any error.

    python -m benchmarks.run [--rounds 3] [--duration 6] [--smoke]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    variant: str
    port: int
    process: subprocess.Popen[bytes] | None = None
    replay_prefix: str = field(default_factory=lambda: secrets.token_hex(4))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_pids(self) -> list[int]:
        assert self.process is not None
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()]

    def cpu_seconds(self) -> float:
        total = 0
        for pid in self.worker_pids():
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        return total / CLOCK_TICKS


@dataclass(frozen=True)
class Row:
    label: str
    server: str
    path: str
    mode: str  # first | replay | none | get
    group: str  # rows that do the same work share a group, for "ahead of every peer"


API = "/api/v1/payments/"
ROWS = [
    Row("(a) plain endpoint, no idempotency", "ours", "/plain/payments/", "none", "plain"),
    Row("(b) ours, first-time keys, database", "ours", API, "first", "first-db"),
    Row("(c) ours, replays, database", "ours", API, "replay", "replay-db"),
    Row("(d) ours, first-time keys, Redis", "ours-redis", API, "first", "first-redis"),
    Row("(e) ours, replays, Redis", "ours-redis", API, "replay", "replay-redis"),
    Row("(f) drf-idempotency, first-time, database", "drfi-db", API, "first", "first-db"),
    Row("(f) drf-idempotency, replays, database", "drfi-db", API, "replay", "replay-db"),
    Row("(f) drf-idempotency, first-time, Redis", "drfi-redis", API, "first", "first-redis"),
    Row("(f) drf-idempotency, replays, Redis", "drfi-redis", API, "replay", "replay-redis"),
    Row("(f) django-idempotency-key, first-time", "dik", API, "first", "first-redis"),
    Row("(f) django-idempotency-key, replays", "dik", API, "replay", "replay-redis"),
    Row("(f) drf-idempotencykey, first-time", "drfik", API, "first", "first-db"),
    Row("(f) drf-idempotencykey, replays", "drfik", API, "replay", "replay-db"),
    Row("(g) bare GET (ceiling)", "ours", "/get/", "get", "ceiling"),
]  # fmt: skip
VARIANTS = ["ours", "ours-redis", "drfi-db", "drfi-redis", "dik", "drfik"]


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
        " 'drf_idempotencykey', 'payments'):\n"
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


def post(url: str, key: str | None, body: str = BODY) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def replay_key(server: Server, number: int) -> str:
    return f"{server.replay_prefix}-0000-4000-8000-{number:012x}"


def create_replay_keys(server: Server, count: int) -> None:
    for number in range(count):
        status, _, body = post(
            server.base + "/api/v1/payments/", replay_key(server, number), body_for(number)
        )
        if status != 201:
            raise RuntimeError(f"{server.variant}: creating a replay key got {status}: {body!r}")


def duplicates_let_through(server: Server, attempts: int = 8) -> int:
    """Fire one new key from several clients at once; count the payments it created."""
    key = f"{secrets.token_hex(4)}-ffff-4000-8000-000000000000"
    url = server.base + "/api/v1/payments/"
    with concurrent.futures.ThreadPoolExecutor(attempts) as pool:
        results = list(pool.map(lambda _: post(url, key), range(attempts)))
    created = {json.loads(body)["transaction_id"] for status, _, body in results if status == 201}
    return len(created)


def wrk(server: Server, row: Row, args: argparse.Namespace, duration: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "BENCH_MODE": row.mode,
        "BENCH_KEY_PREFIX": secrets.token_hex(4),
        "BENCH_REPLAY_KEYS": str(args.replay_keys),
        "BENCH_ACCOUNTS": str(ACCOUNTS),
    }
    if row.mode == "replay":
        env["BENCH_KEY_PREFIX"] = server.replay_prefix
    cpu_before = server.cpu_seconds()
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
    cpu = server.cpu_seconds() - cpu_before
    line = next(line for line in output.splitlines() if line.startswith("WRK_RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("WRK_RESULT "))
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    result["cpu_ms_per_request"] = 1000 * cpu / max(result["requests"], 1)
    return result


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


def summarise(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    def median(row: Row, name: str) -> float:
        return statistics.median(result[name] for result in results[row.label])

    plain = ROWS[0]
    plain_rps, plain_cpu = median(plain, "rps"), median(plain, "cpu_ms_per_request")
    return [
        {
            "row": row.label,
            "group": row.group,
            "rps": median(row, "rps"),
            "p50_ms": median(row, "p50_us") / 1000,
            "p99_ms": median(row, "p99_us") / 1000,
            "cpu_ms": median(row, "cpu_ms_per_request"),
            "ratio": median(row, "rps") / plain_rps,
            "cpu_ratio": median(row, "cpu_ms_per_request") / plain_cpu,
        }
        for row in ROWS
    ]


def table(summary: list[dict[str, Any]], duplicates: dict[str, int]) -> str:
    lines = [
        "| row | req/s | p50 ms | p99 ms | × plain req/s | app CPU ms/req | × plain CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for item in summary:
        lines.append(
            f"| {item['row']} | {item['rps']:.0f} | {item['p50_ms']:.1f} | {item['p99_ms']:.1f} "
            f"| {item['ratio']:.2f} | {item['cpu_ms']:.2f} | {item['cpu_ratio']:.2f} |"
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
    servers = {variant: Server(variant, 8301 + index) for index, variant in enumerate(VARIANTS)}
    load_before = os.getloadavg()
    try:
        for server in servers.values():
            start(server, args)
        for server in servers.values():
            wait_until_up(server)
            print(f"{server.variant}: up; creating replay keys", file=sys.stderr)
            create_replay_keys(server, args.replay_keys)
        smoke_replay = post(
            servers["ours"].base + "/api/v1/payments/", replay_key(servers["ours"], 0)
        )
        if smoke_replay[1].get("Idempotent-Replay") != "true":
            raise RuntimeError(f"our replay was not a replay: {smoke_replay}")
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
            shift = round_number % len(ROWS)
            for row in ROWS[shift:] + ROWS[:shift]:
                result = wrk(servers[row.server], row, args, args.duration)
                results[row.label].append(result)
                print(f"round {round_number + 1}/{args.rounds}: {row.label}: "
                      f"{result['rps']:.0f} req/s", file=sys.stderr)  # fmt: skip
    finally:
        for server in servers.values():
            stop(server)
    summary = summarise(results)
    report = {
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"} | {"body": BODY},
        "summary": summary,
        "duplicates": duplicates,
        "raw": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(table(summary, duplicates))
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
