"""Paged KV cache bookkeeping: a pool of fixed-size blocks and a block table per request.

A request's KV entries live in ``ceil(length / block_size)`` blocks anywhere in the pool;
token ``t`` of a request is stored at slot ``table[t // block_size] * block_size +
t % block_size``. Admission asks :meth:`BlockManager.can_allocate` first, so a request
that does not fit waits instead of running the server out of memory; blocks return to
the pool the moment a request finishes, fails or is aborted (:meth:`release` is idempotent).
All bookkeeping is on the host: it runs between steps, never inside a captured graph.

Prefix caching: a block whose tokens are all prompt tokens can be registered (:meth:`register`)
under a key that names its content and everything before it (the engine chains content
digests of the prompt's embeddings, :func:`~omnistage.engine.sequence.block_keys`). A later
request whose prompt begins with the same blocks takes them (:meth:`match`, then
:meth:`allocate` with them as its first blocks) instead of computing them: blocks are
shared, counted by their holders. A registered block no request holds keeps its content
and counts as free; it is reused for new blocks only when no never-used block is left,
least recently released first (eviction under pressure), and then forgets its key.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than the request needs (callers check
    :meth:`BlockManager.can_allocate` first; this is a scheduler bug, not a user error)."""


class BlockManager:
    """Args:
    num_blocks: blocks in the pool (>= 1).
    block_size: tokens per block (>= 1).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need num_blocks >= 1 and block_size >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))  # blocks with no content to keep
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}
        self._holders: dict[int, int] = {}  # block -> requests holding it (held blocks only)
        self._by_key: dict[bytes, int] = {}  # registered blocks
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unheld; oldest first

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (registered ones included: they are reused on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (held or not)."""
        return len(self._by_key)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest run of leading ``keys`` (a prompt's
        :func:`~omnistage.engine.sequence.block_keys`)."""
        blocks = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether a new request of ``num_tokens`` tokens fits now, its first blocks being
        the registered ``cached`` (from :meth:`match`)."""
        new = self.blocks_needed(num_tokens) - len(cached)
        unheld_cached = sum(1 for block in cached if block in self._evictable)
        return new <= self.num_free_blocks - unheld_cached

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Blocks for a new request's ``num_tokens`` tokens, the registered ``cached``
        first (shared, never written by it); its block table.

        Raises:
            ValueError: the request already holds blocks, or ``cached`` are not registered
                blocks or do not fit in ``num_tokens``.
            OutOfBlocksError: not enough free blocks.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if len(cached) > self.blocks_needed(num_tokens) or any(b not in self._key_of for b in cached):
            raise ValueError("cached blocks must be registered blocks within the request's tokens")
        if not self.can_allocate(num_tokens, cached):
            raise OutOfBlocksError(f"need {self.blocks_needed(num_tokens) - len(cached)} KV blocks, {self.num_free_blocks} free")
        for block in cached:
            self._evictable.pop(block, None)
            self._holders[block] = self._holders.get(block, 0) + 1
        new = self._take(self.blocks_needed(num_tokens) - len(cached))
        self._tables[request_id] = [*cached, *new]
        self._lengths[request_id] = num_tokens
        return list(self._tables[request_id])

    def register(self, request_id: str, keys: Sequence[bytes]) -> None:
        """Register the request's first blocks under ``keys`` (one per block, all full of
        prompt tokens whose KV is written); a key already registered keeps its block."""
        table = self._tables[request_id]
        for block, key in zip(table, keys, strict=False):
            if key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = key

    def slots(self, request_id: str) -> list[int]:
        """Slot index of every token the request holds, in order."""
        table, size = self._tables[request_id], self.block_size
        return [table[t // size] * size + t % size for t in range(self._lengths[request_id])]

    def release(self, request_id: str) -> None:
        """Drop the request's hold on its blocks; a request without blocks is ignored."""
        for block in self._tables.pop(request_id, ()):
            self._holders[block] -= 1
            if self._holders[block]:
                continue
            del self._holders[block]
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        self._lengths.pop(request_id, None)

    def live_requests(self) -> set[str]:
        return set(self._tables)

    def _take(self, count: int) -> list[int]:
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently released registered block
                block, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
            self._holders[block] = 1
            blocks.append(block)
        return blocks
