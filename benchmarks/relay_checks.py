"""What the relay benchmarks check and count, shared by relay_deployed.py and relay_fleet.py."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["database_cpu_seconds", "first_sends", "reordered"]


def first_sends(sent: Iterable[tuple[int, int]]) -> dict[int, int]:
    """When each event (by id) was first sent, from ``(time, id)`` pairs in time order."""
    first: dict[int, int] = {}
    for at, pk in sent:
        first.setdefault(pk, at)
    return first


def reordered(first: Mapping[int, int], key_of: Mapping[int, str]) -> int:
    """How many events went out, for the first time, after a later event of their key."""
    count = 0
    last_by_key: dict[str, int] = {}
    for pk, _ in sorted(first.items(), key=lambda item: item[1]):
        key = key_of[pk]
        if key and last_by_key.get(key, 0) > pk:
            count += 1
        if key:
            last_by_key[key] = max(last_by_key.get(key, 0), pk)
    return count


def database_cpu_seconds() -> float:
    """CPU of PostgreSQL's processes on this machine, from /proc: each live process's own, and
    the postmaster's count of its ended children (a relay's backend ends with the relay)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if "(postgres)" in stat:
            total += sum(int(value) for value in stat.rsplit(")", 1)[1].split()[11:15])
    return total / os.sysconf("SC_CLK_TCK")
