"""HostTier: encoded entries in host memory, bounded in bytes, least recently used out first."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity {capacity_bytes} bytes; give a positive size")
        self.capacity = capacity_bytes
        self.used = 0
        self._lru: OrderedDict[str, bytes] = OrderedDict()

    def put(self, key: str, blob: bytes) -> list[tuple[str, bytes]]:
        """Keep `blob` as the most recent entry; returns the entries pushed out to make room (oldest
        first), for the tier below. An entry larger than the whole tier is returned itself."""
        if len(blob) > self.capacity:
            return [(key, blob)]
        self.pop(key)
        self._lru[key] = blob
        self.used += len(blob)
        out = []
        while self.used > self.capacity:
            k, b = self._lru.popitem(last=False)
            self.used -= len(b)
            out.append((k, b))
        return out

    def get(self, key: str) -> Optional[bytes]:
        """The entry (now the most recent), or None."""
        blob = self._lru.get(key)
        if blob is not None:
            self._lru.move_to_end(key)
        return blob

    def pop(self, key: str) -> Optional[bytes]:
        blob = self._lru.pop(key, None)
        if blob is not None:
            self.used -= len(blob)
        return blob

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        self._lru.clear()
        self.used = 0
