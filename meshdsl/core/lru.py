"""A bounded, thread-safe map that keeps the most recently used entries.

The compiler and the runtime cache what they work out again and again for the same inputs (a
node's lowering choice under many layouts, a generated program's code object); each cache keeps
its last ``size`` entries, and executors may be built on several threads.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class Lru:
    """The last ``size`` entries of ``key -> value`` used, looked up and filled under a lock."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``key``'s value; made by ``make()`` (outside the lock) and kept when it is missing."""
        with self._lock:
            found = self._entries.get(key, _MISSING)
            if found is not _MISSING:
                self._entries.move_to_end(key)
                return found
        value = make()
        with self._lock:
            self._entries[key] = value
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)


_MISSING = object()
