"""SQL statements per request, counted in each gunicorn worker and read by ``benchmarks.run``.

PostgreSQL here has no ``pg_stat_statements`` (and the shared server is not reconfigured for a
benchmark), so each worker counts the statements its Django connections execute, through an
execute wrapper installed on every new connection. The count lives in an 8-byte file per worker,
mapped into memory: a write per statement costs a memory store, not a system call, and the
benchmark reads the files between rows. ``BENCH_COUNT_DIR`` unset: nothing is counted.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db.backends.signals import connection_created

_COUNTER = struct.Struct("=Q")
_state: dict[str, Any] = {"pid": None, "map": None, "count": 0}


def _counter() -> mmap.mmap:
    """This process's counter file, opened once per process (gunicorn forks the workers)."""
    if _state["pid"] != os.getpid():
        path = Path(os.environ["BENCH_COUNT_DIR"]) / f"{os.environ['BENCH_VARIANT']}-{os.getpid()}"
        path.write_bytes(bytes(_COUNTER.size))
        with path.open("r+b") as file:
            _state["map"] = mmap.mmap(file.fileno(), _COUNTER.size)
        _state["pid"], _state["count"] = os.getpid(), 0
    counter: mmap.mmap = _state["map"]
    return counter


def _count(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
    counter = _counter()
    _state["count"] += 1
    _COUNTER.pack_into(counter, 0, _state["count"])
    return execute(sql, params, many, context)


def _on_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    if _count not in connection.execute_wrappers:
        connection.execute_wrappers.insert(0, _count)


def install() -> None:
    if os.environ.get("BENCH_COUNT_DIR"):
        connection_created.connect(_on_connection, dispatch_uid="bench-statement-counter")


def total(directory: Path, variant: str) -> int:
    """Statements executed so far by every worker of ``variant`` (``ours``, not ``ours-redis``)."""
    return sum(
        _COUNTER.unpack(path.read_bytes()[: _COUNTER.size])[0]
        for path in directory.glob(f"{variant}-*")
        if path.name.removeprefix(f"{variant}-").isdigit()
    )
