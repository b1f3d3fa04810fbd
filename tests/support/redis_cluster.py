"""A real Redis Cluster for the Redis copy's tests: three masters and three replicas, each a
redis-server child process on loopback ports of its own, made with ``redis-cli --cluster create``.

The nodes note their pids under ``CLUSTER_STATE`` (and their directory), so a run that crashed
before its finalizer ran is cleaned up by the next one, as tests/reliability/services.py does for
its private Redis. The shared Redis on 6379 is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.ports import free_ports
from tests.support.servers import process_alive

#: Where the nodes of a cluster note their pids: ``<pytest pid>-<port>.pid`` and
#: ``<pytest pid>.dir`` (the cluster's temporary directory).
CLUSTER_STATE = Path(tempfile.gettempdir()) / "django_idempotency_redis_cluster"
#: How long a master may be silent before its replica takes over (redis default: 15 s).
NODE_TIMEOUT_MS = 1000


def kill_stale_clusters() -> None:
    """Kill the nodes of earlier runs whose pytest process is gone, and remove their files."""
    if not CLUSTER_STATE.is_dir():
        return
    for note in CLUSTER_STATE.iterdir():
        owner = int(note.name.split("-")[0].split(".")[0])
        if process_alive(owner):
            continue
        with contextlib.suppress(ValueError, OSError):
            if note.suffix == ".dir":
                shutil.rmtree(note.read_text(), ignore_errors=True)
            else:
                pid = int(note.read_text())
                if b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
        note.unlink(missing_ok=True)


@dataclass
class Node:
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start (or start again: the node's cluster config survives, so it rejoins)."""
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes",
             "--cluster-config-file", str(self.directory / f"nodes-{self.port}.conf"),
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--dir", str(self.directory),
             "--logfile", str(self.directory / f"redis-{self.port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        CLUSTER_STATE.mkdir(exist_ok=True)
        (CLUSTER_STATE / f"{os.getpid()}-{self.port}.pid").write_text(str(self.process.pid))

    def kill(self) -> None:
        """SIGKILL: no shutdown, no failover handed over; the cluster has to notice."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def ping(self) -> bool:
        with self.client() as client:
            return bool(client.ping())

    def info(self, command: str) -> dict[str, str]:
        """``CLUSTER INFO`` or ``INFO replication`` as a dict; empty if the node does not answer."""
        try:
            with self.client() as client:
                raw = client.execute_command(*command.split())
        except Exception:  # a node starting or dead answers nothing useful
            return {}
        if isinstance(raw, dict):  # redis-py parses both replies into dicts
            return {str(name): str(value) for name, value in raw.items()}
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        lines = (line.partition(":") for line in text.splitlines() if ":" in line)
        return {name: value.strip() for name, _, value in lines}


@dataclass
class LocalRedisCluster:
    directory: Path
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @classmethod
    def start(cls) -> LocalRedisCluster:
        kill_stale_clusters()
        directory = Path(tempfile.mkdtemp(prefix="di-redis-cluster-"))
        CLUSTER_STATE.mkdir(exist_ok=True)
        (CLUSTER_STATE / f"{os.getpid()}.dir").write_text(str(directory))
        ports = free_ports(6, paired_offset=10000)  # each with its cluster bus port, port + 10000
        cluster = cls(directory, [Node(port, directory) for port in ports])
        try:
            for node in cluster.nodes:
                node.start()
            for node in cluster.nodes:
                cluster._wait(node.ping, what=f"redis-server on {node.port}")
            addresses = [f"127.0.0.1:{node.port}" for node in cluster.nodes]
            created = subprocess.run(
                ["redis-cli", "--cluster", "create", *addresses,
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}")
            cluster.wait_healthy()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _wait(self, condition: Any, seconds: float = 30, what: str = "the cluster") -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if condition():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"{what} was not ready after {seconds} s (logs in {self.directory})")

    def running(self) -> list[Node]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def wait_healthy(self, seconds: float = 30) -> None:
        """Every running node says ``cluster_state:ok``, three masters, and each has a replica
        in sync (so the next failover has somewhere to go)."""

        def healthy() -> bool:
            running = self.running()
            if any(n.info("CLUSTER INFO").get("cluster_state") != "ok" for n in running):
                return False
            roles = [n.info("INFO replication") for n in running]
            masters = [r for r in roles if r.get("role") == "master"]
            replicas = [r for r in roles if r.get("role") == "slave"]
            return (
                len(masters) == 3
                and len(replicas) == len(running) - 3
                and all(r.get("master_link_status") == "up" for r in replicas)
            )

        self._wait(healthy, seconds, "a healthy cluster")

    def master_of(self, key: str) -> Node:
        """The node serving ``key``'s slot now, as the cluster itself says."""
        with self.running()[0].client() as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no master serves {key!r}")

    def replica_of(self, master: Node) -> Node:
        for node in self.running():
            role = node.info("INFO replication")
            if role.get("role") == "slave" and role.get("master_port") == str(master.port):
                return node
        raise RuntimeError(f"the master on {master.port} has no replica")

    def wait_for_master(self, node: Node, seconds: float = 30) -> None:
        """Until ``node`` is a master that the cluster routes slots to, and the cluster is ok."""

        def serving() -> bool:
            running = self.running()
            if any(n.info("CLUSTER INFO").get("cluster_state") != "ok" for n in running):
                return False
            with running[0].client() as client:
                slots = client.execute_command("CLUSTER", "SLOTS")
            return any(int(master[1]) == node.port for _, _, master, *_ in slots)

        self._wait(serving, seconds, f"the node on {node.port} as a master")

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
            (CLUSTER_STATE / f"{os.getpid()}-{node.port}.pid").unlink(missing_ok=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        (CLUSTER_STATE / f"{os.getpid()}.dir").unlink(missing_ok=True)


@contextlib.contextmanager
def local_cluster() -> Iterator[LocalRedisCluster]:
    """A fresh cluster, stopped and its directory removed however the block ends."""
    cluster = LocalRedisCluster.start()
    try:
        yield cluster
    finally:
        cluster.close()
