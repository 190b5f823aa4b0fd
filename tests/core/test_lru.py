"""BoundedLRU: the bounds (entries, cost), least-recently-used order, an oversize value,
and what two threads that miss the same key at once get."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from omnistage.core.lru import BoundedLRU


def test_the_entry_bound_drops_the_least_recently_used():
    lru: BoundedLRU[str, int] = BoundedLRU(max_entries=3)
    for i, key in enumerate("abc"):
        lru.put(key, i)
    assert lru.get("a") == 0  # a is now the most recent: b goes next
    lru.put("d", 3)
    assert [k in lru for k in "abcd"] == [True, False, True, True] and len(lru) == 3
    lru.put("c", 99)  # already stored: keeps its value, becomes the most recent
    lru.put("e", 4)
    assert lru.get("c") == 2 and "a" not in lru and len(lru) == 3


def test_in_and_len_leave_the_order_alone():
    lru: BoundedLRU[str, int] = BoundedLRU(max_entries=2)
    lru.put("a", 0)
    lru.put("b", 1)
    assert "a" in lru and len(lru) == 2
    lru.put("c", 2)
    assert "a" not in lru and lru.get("b") == 1


def test_the_cost_bound_sums_the_costs_of_the_values():
    lru: BoundedLRU[str, bytes] = BoundedLRU(max_cost=10, cost=len)
    lru.put("a", b"x" * 4)
    lru.put("b", b"x" * 4)
    assert lru.total_cost == 8
    lru.put("c", b"x" * 3)  # 11 > 10: a goes
    assert "a" not in lru and lru.total_cost == 7 and len(lru) == 2
    lru.put("d", b"x" * 10)  # exactly the bound: everything else goes
    assert list(k for k in "abcd" if k in lru) == ["d"] and lru.total_cost == 10


def test_a_value_costlier_than_the_bound_is_not_kept_and_drops_nothing():
    lru: BoundedLRU[str, bytes] = BoundedLRU(max_cost=10, cost=len)
    lru.put("a", b"x" * 6)
    lru.put("big", b"x" * 11)
    assert "big" not in lru and lru.get("a") == b"x" * 6 and lru.total_cost == 6
    value = b"y" * 11
    assert lru.get_or_compute("big", lambda: value) is value  # the caller still gets it
    assert "big" not in lru and len(lru) == 1


def test_both_bounds_hold_at_once():
    lru: BoundedLRU[str, bytes] = BoundedLRU(max_entries=2, max_cost=100, cost=len)
    for key in "abc":
        lru.put(key, b"x")
    assert len(lru) == 2 and lru.total_cost == 2
    lru.put("d", b"x" * 99)  # 101 > 100: b goes (the cost bound), c stays
    assert [k for k in "abcd" if k in lru] == ["c", "d"] and lru.total_cost == 100


def test_a_zero_bound_keeps_nothing_that_counts_against_it():
    for lru in (BoundedLRU(max_entries=0), BoundedLRU(max_cost=0, cost=len)):
        lru.put("a", b"x")
        assert len(lru) == 0 and lru.get("a") is None and lru.total_cost == 0
    free: BoundedLRU[str, bytes] = BoundedLRU(max_cost=0, cost=len)
    free.put("a", b"")  # costs nothing: within a bound of 0
    assert free.get("a") == b""


def test_put_many_enforces_the_bound_after_the_whole_batch():
    """A stored key later in the batch is refreshed before anything is dropped: with
    [a, b] stored and the batch [c, a], b goes, not a (a per-item bound would drop a)."""
    lru: BoundedLRU[str, int] = BoundedLRU(max_entries=2)
    lru.put("a", 0)
    lru.put("b", 1)
    lru.put_many([("c", 2), ("a", 0)])
    assert [k for k in "abc" if k in lru] == ["a", "c"]
    lru.put_many([(k, i) for i, k in enumerate("wxyz")])  # the batch alone passes: its earliest go
    assert [k for k in "acwxyz" if k in lru] == ["y", "z"]


def test_get_or_compute_computes_once_per_key_and_not_on_errors():
    lru: BoundedLRU[str, int] = BoundedLRU(max_entries=4)
    calls = []

    def compute() -> int:
        calls.append(1)
        return 7

    assert lru.get_or_compute("a", compute) == 7 and lru.get_or_compute("a", compute) == 7
    assert len(calls) == 1

    def broken() -> int:
        raise RuntimeError("compute failed")

    with pytest.raises(RuntimeError, match="compute failed"):
        lru.get_or_compute("b", broken)
    assert "b" not in lru and len(lru) == 1


def test_two_threads_that_miss_one_key_both_compute_and_get_the_first_stored():
    """The lock is not held while computing: both threads are inside compute at once
    (the barrier would time out otherwise), and both get the value stored first."""
    lru: BoundedLRU[str, object] = BoundedLRU(max_entries=4)
    inside = threading.Barrier(2, timeout=10)
    made: list[object] = []
    results: list[object] = []

    def compute() -> object:
        inside.wait()  # both threads missed and are computing
        value = object()
        made.append(value)
        return value

    threads = [threading.Thread(target=lambda: results.append(lru.get_or_compute("k", compute))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 2 and made[0] is not made[1] and len(results) == 2
    assert results[0] is results[1] is lru.get("k") and results[0] in made
    assert len(lru) == 1


def test_the_bounds_hold_under_threads():
    lru: BoundedLRU[int, bytes] = BoundedLRU(max_entries=5, max_cost=5 * 8, cost=len)
    values = [bytes([i]) * 8 for i in range(12)]
    start = threading.Barrier(8, timeout=10)

    def work(offset: int) -> None:
        start.wait()
        for i in range(300):
            key = (offset + i) % len(values)
            got = lru.get_or_compute(key, lambda key=key: values[key])
            assert got is values[key]

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert len(lru) == 5 and lru.total_cost == 5 * 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "needs max_entries"),
        ({"max_entries": -1}, "bounds must be >= 0"),
        ({"max_cost": -1, "cost": len}, "bounds must be >= 0"),
        ({"max_cost": 10}, "cost is given with max_cost"),
        ({"max_entries": 10, "cost": len}, "cost is given with max_cost"),
    ],
)
def test_bad_bounds_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BoundedLRU(**kwargs)


def test_a_negative_cost_is_refused_and_nothing_is_stored():
    lru: BoundedLRU[str, int] = BoundedLRU(max_cost=10, cost=lambda v: v)
    with pytest.raises(ValueError, match="cost must be >= 0"):
        lru.put("a", -1)
    assert len(lru) == 0 and lru.total_cost == 0
