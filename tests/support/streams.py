"""Request bodies made on demand, for tests that must not allocate what they send."""

from __future__ import annotations

import io


class Firehose(io.RawIOBase):
    """A body of ``size`` bytes, made as it is read, counting what was read (``taken``)."""

    def __init__(self, size: int, byte: bytes = b"x") -> None:
        self.size = size
        self.byte = byte
        self.taken = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = min(len(buffer), self.size - self.taken)
        buffer[:count] = self.byte * count
        self.taken += count
        return count
