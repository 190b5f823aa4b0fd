"""Paged KV cache bookkeeping: a pool of fixed-size blocks and a block table per request.

A request's KV entries live in ``ceil(length / block_size)`` blocks anywhere in the pool;
token ``t`` of a request is stored at slot ``table[t // block_size] * block_size +
t % block_size``. Admission asks :meth:`BlockManager.can_allocate` first, so a request
that does not fit waits instead of running the server out of memory; blocks return to
the pool the moment a request finishes, fails or is aborted (:meth:`free` is idempotent).
All bookkeeping is on the host: it runs between steps, never inside a captured graph.
"""

from __future__ import annotations

import math
from collections import deque


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than the request needs (callers check
    :meth:`BlockManager.can_allocate` first; this is a scheduler bug, not a user error)."""


def num_blocks_for_budget(
    kv_cache_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int
) -> int:
    """Blocks that fit in ``kv_cache_bytes``: one block holds K and V of ``block_size``
    tokens in every layer, ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes *
    block_size`` bytes.

    Raises:
        ValueError: the budget holds no block.
    """
    per_block = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size
    blocks = kv_cache_bytes // per_block
    if blocks < 1:
        raise ValueError(f"a KV budget of {kv_cache_bytes} bytes holds no block of {per_block} bytes")
    return blocks


class BlockManager:
    """Args:
    num_blocks: blocks in the pool (>= 1).
    block_size: tokens per block (>= 1).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need num_blocks >= 1 and block_size >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request of ``num_tokens`` prompt tokens fits now."""
        return self.blocks_needed(num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Blocks for a new request's ``num_tokens`` prompt tokens; its block table.

        Raises:
            ValueError: the request already holds blocks.
            OutOfBlocksError: not enough free blocks.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        self._tables[request_id] = self._take(self.blocks_needed(num_tokens))
        self._lengths[request_id] = num_tokens
        return list(self._tables[request_id])

    def slots(self, request_id: str) -> list[int]:
        """Slot index of every token the request holds, in order."""
        table, size = self._tables[request_id], self.block_size
        return [table[t // size] * size + t % size for t in range(self._lengths[request_id])]

    def release(self, request_id: str) -> None:
        """Return the request's blocks to the pool; a request without blocks is ignored."""
        self._free.extend(self._tables.pop(request_id, ()))
        self._lengths.pop(request_id, None)

    def live_requests(self) -> set[str]:
        return set(self._tables)

    def _take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]
