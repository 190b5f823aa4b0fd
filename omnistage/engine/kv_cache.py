"""The paged KV pool: K and V of every layer in fixed-size blocks of slots.

Token ``t`` of a request lives at slot ``table[t // block_size] * block_size + t %
block_size`` (see :mod:`omnistage.engine.block_manager`). The pool's last block is a
scratch block no request ever owns: the padding rows of a captured decode step (a batch
padded up to its CUDA-graph bucket) read and write there, never in a live request's blocks.

On CPU the buffers come from ``calloc`` (through :func:`numpy.zeros`): the kernel maps
zero pages and commits each on its first write, so a pool sized for the worst case costs
resident memory only for the tokens actually stored.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from omnistage.engine.block_manager import num_blocks_for_budget


def kv_budget_bytes(device: torch.device, kv_cache_bytes: int | None, mem_fraction_static: float | None) -> int:
    """The KV pool's byte budget: ``kv_cache_bytes`` if given, else ``mem_fraction_static``
    of the device memory free now (``torch.cuda.mem_get_info``), i.e. after the weights
    and whatever else this process has already allocated.

    Raises:
        ValueError: neither or both are given, the fraction is outside (0, 1], or a
            fraction is asked for on a device whose free memory is not the pool's to
            take (CPU: host memory is shared with everything else on the machine).
    """
    if (kv_cache_bytes is None) == (mem_fraction_static is None):
        raise ValueError("give exactly one of kv_cache_bytes and mem_fraction_static")
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    assert mem_fraction_static is not None
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    if device.type != "cuda":
        raise ValueError(f"mem_fraction_static needs a CUDA device (got {device}); give kv_cache_bytes")
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * mem_fraction_static)


class PagedKVCache:
    """K and V buffers ``[num_layers, num_blocks * block_size, num_kv_heads, head_dim]``.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention geometry.
        num_blocks: blocks in the pool, the scratch block included (>= 2).
        block_size: tokens per block.
        dtype, device: of the buffers.

    Attributes:
        num_usable_blocks: blocks requests can own (all but the scratch block).
        scratch_block: the scratch block's index.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs >= 2 blocks (one is scratch), got {num_blocks}")
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.block_size = block_size
        self.num_usable_blocks = num_blocks - 1
        self.scratch_block = num_blocks - 1

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PagedKVCache:
        """As many blocks as fit in ``budget_bytes``.

        Raises:
            ValueError: the budget holds fewer than 2 blocks.
        """
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        blocks = num_blocks_for_budget(budget_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)
        return cls(num_layers, num_kv_heads, head_dim, blocks, block_size, dtype, device)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros of ``shape``; on CPU backed by ``calloc``, committed page by page on first
    write (``torch.zeros`` writes every byte, making the whole pool resident at once)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
