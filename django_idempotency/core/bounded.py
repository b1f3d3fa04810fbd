"""A bounded table of what a process saw lately, for hints it may lose at any moment."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Recently"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recently(Generic[K, V]):
    """At most ``entries`` items, kept until the table is full, then started again empty.

    For what a process may forget at the price of redoing some work (a fingerprint, a read):
    no lock and no order kept up on every hit, as a least-recently-used table would need. A
    full table is replaced by a new one, not cleared, so a thread reading the old one
    meanwhile is unharmed. With no entries it keeps nothing.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: K, value: V) -> None:
        if not self.entries:
            return
        if len(self._items) >= self.entries:
            self._items = {}
        self._items[key] = value

    def clear(self) -> None:
        self._items = {}
