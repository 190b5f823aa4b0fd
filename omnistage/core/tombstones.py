"""Tombstones: ids of requests that ended, so late messages never recreate their state."""

from __future__ import annotations

import time
from collections import OrderedDict

TOMBSTONE_TTL_S = 300.0  # long past any in-flight message of a finished request


class Tombstones:
    """Ids of requests that ended recently (insertion-ordered, expiring after ``ttl_s``)."""

    def __init__(self, ttl_s: float = TOMBSTONE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._ids[request_id] = now
        self._ids.move_to_end(request_id)
        while self._ids and next(iter(self._ids.values())) < now - self.ttl_s:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids
