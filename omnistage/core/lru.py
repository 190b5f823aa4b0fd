"""A bounded least-recently-used map: the one cache behind every content-keyed cache.

Architecture rule 8: such a cache's key is derived from the content it stands for (a
SHA-256 of a clip, of reference codes), so one request's entry can never stand in for
another's. The users: loaded reference clips (:class:`omnistage.serve.media.ReferenceCache`,
bounded in bytes), Qwen3-TTS's encoded references and prompt rows of reference codes, and
the vocoder arena's decoder states after a left context (bounded in entries).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["BoundedLRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """Values by key, least recently used out first once a bound is passed.

    Bounds: ``max_entries`` counts entries; ``max_cost`` sums ``cost(value)`` over the
    entries (e.g. bytes), each value's cost taken once, when it is stored. Either or both.
    ``max_entries=0`` keeps nothing, ``max_cost=0`` only values of cost 0. A value whose
    cost alone exceeds ``max_cost`` is not kept, and nothing is dropped for it (no error:
    the caller still has the value; a later lookup misses).

    Recency: :meth:`get` (a hit) and :meth:`put` make the key the most recently used;
    ``in`` and ``len`` do not. A value is never None (:meth:`get` returns None for a miss).

    Thread safety: every method holds one lock for its bookkeeping only;
    :meth:`get_or_compute` does NOT hold it while computing (a compute may be a tensor op
    of milliseconds). So two threads that miss the same key at once both compute it; the
    first value stored stays, and both get that one (the later one's value is dropped).

    Args:
        max_entries: entries kept at most; None: no bound on the count.
        max_cost: total cost kept at most, in ``cost``'s unit; None: no bound on the cost.
        cost: the cost of a value (an int >= 0, e.g. ``array.nbytes``); needed with
            ``max_cost`` and only then.

    Raises:
        ValueError: no bound, a negative bound, or ``cost`` given without ``max_cost`` or
            missing with it.
    """

    def __init__(
        self,
        *,
        max_entries: int | None = None,
        max_cost: int | None = None,
        cost: Callable[[V], int] | None = None,
    ) -> None:
        if max_entries is None and max_cost is None:
            raise ValueError("a BoundedLRU needs max_entries, max_cost or both")
        if (max_entries is not None and max_entries < 0) or (max_cost is not None and max_cost < 0):
            raise ValueError(f"bounds must be >= 0, got max_entries={max_entries}, max_cost={max_cost}")
        if (cost is None) != (max_cost is None):
            raise ValueError("cost is given with max_cost and only with it")
        self.max_entries, self.max_cost = max_entries, max_cost
        self._cost = cost
        self._total_cost = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        """Whether ``key`` is stored (its recency unchanged)."""
        return key in self._entries

    @property
    def total_cost(self) -> int:
        """The sum of the stored values' costs (0 without a ``cost``)."""
        return self._total_cost

    def get(self, key: K) -> V | None:
        """The value stored under ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key`` (a key already stored keeps its value), as the most
        recently used, dropping the least recently used beyond the bounds.

        Raises:
            ValueError: ``cost(value)`` is negative.
        """
        self.put_many([(key, value)])

    def put_many(self, items: Iterable[tuple[K, V]]) -> None:
        """:meth:`put` each item in order, the bounds enforced once after the last: an item
        is dropped for the batch only if the batch alone passes a bound (then its
        earliest are).

        Raises:
            ValueError: a ``cost(value)`` is negative (the items before it are kept).
        """
        with self._lock:
            try:
                for key, value in items:
                    self._store(key, value)
            finally:
                self._evict()

    def get_or_compute(self, key: K, compute: Callable[[], V]) -> V:
        """The value stored under ``key``, else ``compute()``'s, stored (:meth:`put`);
        the lock is not held while computing (the class docstring says what a race does).

        Raises:
            ValueError: ``cost`` of the computed value is negative.
            Whatever ``compute`` raises (nothing is stored).
        """
        found = self.get(key)
        if found is not None:
            return found
        value = compute()
        with self._lock:
            try:
                return self._store(key, value)
            finally:
                self._evict()

    def _store(self, key: K, value: V) -> V:
        """Store or refresh one entry (lock held); returns the value now under ``key``
        (``value`` itself when it is not kept)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry[0]
        cost = 0 if self._cost is None else self._cost(value)
        if cost < 0:
            raise ValueError(f"cost must be >= 0, got {cost}")
        if self.max_entries == 0 or (self.max_cost is not None and cost > self.max_cost):
            return value
        self._entries[key] = (value, cost)
        self._total_cost += cost
        return value

    def _evict(self) -> None:
        """Drop the least recently used entries until within the bounds (lock held)."""
        while (self.max_entries is not None and len(self._entries) > self.max_entries) or (
            self.max_cost is not None and self._total_cost > self.max_cost
        ):
            _, (_, cost) = self._entries.popitem(last=False)
            self._total_cost -= cost
