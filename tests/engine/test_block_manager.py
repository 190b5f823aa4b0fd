"""Paged KV bookkeeping: admission by free blocks, slots, freeing, no double use."""

import random

import pytest

from omnistage.engine.block_manager import BlockManager, OutOfBlocksError


def test_prompt_takes_ceil_blocks_and_admission_checks_free_blocks():
    manager = BlockManager(num_blocks=4, block_size=16)
    assert len(manager.allocate("a", 17)) == 2
    assert manager.can_allocate(32) and not manager.can_allocate(33)
    with pytest.raises(OutOfBlocksError):
        manager.allocate("b", 33)
    assert manager.num_free_blocks == 2 and manager.live_requests() == {"a"}


def test_slots_follow_the_block_table():
    manager = BlockManager(num_blocks=3, block_size=4)
    table = manager.allocate("a", 6)
    assert manager.slots("a") == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]


def test_release_is_immediate_and_idempotent():
    manager = BlockManager(num_blocks=2, block_size=8)
    manager.allocate("a", 16)
    manager.release("a")
    manager.release("a")
    manager.release("never-allocated")
    assert manager.num_free_blocks == 2 and not manager.live_requests()


def test_random_workload_never_shares_a_block_and_returns_all():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=64, block_size=8)
    live: set[str] = set()
    for i in range(2000):
        if live and rng.random() < 0.3:
            manager.release(live.pop())
        elif manager.can_allocate(n := rng.randint(1, 40)):
            manager.allocate(f"r{i}", n)
            live.add(f"r{i}")
        slots = [slot for r in live for slot in manager.slots(r)]
        assert len(slots) == len(set(slots))  # no slot (so no block) is shared
        held = sum(manager.blocks_needed(len(manager.slots(r))) for r in live)
        assert held + manager.num_free_blocks == 64
    for request_id in live:
        manager.release(request_id)
    assert manager.num_free_blocks == 64
