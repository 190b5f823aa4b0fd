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


def kv_token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V in every layer: ``2 * num_layers * num_kv_heads *
    head_dim * dtype size`` (Qwen3-Omni-30B-A3B's thinker in bf16, 48 layers of 4 KV heads
    of 128: 96 KiB; its talker, 20 layers of 2: 20 KiB)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def kv_pool_blocks(
    token_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    kv_cache_bytes: int | None,
    mem_fraction_static: float,
    free_bytes: int | None,
) -> int:
    """Blocks of the KV pool, its scratch block included (the engine's sizing rule).

    - ``kv_cache_bytes`` given: as many blocks as fit in it, whatever the device.
    - Else the pool holds what the engine can ever use at once, ``max_num_seqs`` requests
      of ``max_model_len`` tokens, and where ``free_bytes`` is known (CUDA: the device's
      free memory when the engine is built, i.e. after this process's weights, the pools
      and CUDA graphs of stages built before it, and other processes' memory) at most
      ``mem_fraction_static`` of it; the rest stays free for activations, this engine's
      CUDA graphs and later stages. On CPU (``free_bytes`` None) it is not capped: host
      memory is shared with the whole machine, and the pool's pages are committed only as
      tokens are written (see the module docstring).

    So engines built one after another on one device (Qwen3-Omni's thinker, then its
    talker) each get their whole need while their needs fit, whatever the order; when
    memory is short, the first takes ``mem_fraction_static`` of the free memory and the
    next that fraction of what is left (give ``kv_cache_bytes`` per stage to split it
    otherwise).

    Args:
        token_bytes: :func:`kv_token_bytes` of the model.
        block_size: tokens per block.
        max_num_seqs, max_model_len: the engine's limits.
        kv_cache_bytes: the explicit budget in bytes, or None.
        mem_fraction_static: in (0, 1].
        free_bytes: free device memory in bytes (``torch.cuda.mem_get_info``), None on CPU.

    Raises:
        ValueError: ``mem_fraction_static`` outside (0, 1], or a pool that cannot hold one
            request of ``max_model_len`` plus the scratch block (the message names the
            knob that sized it and the bytes such a pool needs).
    """
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    block_bytes = token_bytes * block_size
    one_request = math.ceil(max_model_len / block_size) + 1  # + the scratch block
    blocks = max_num_seqs * (one_request - 1) + 1  # the need
    sized_by = f"max_num_seqs {max_num_seqs} x max_model_len {max_model_len}"
    fix = "raise max_num_seqs"
    allowed = None if free_bytes is None else int(free_bytes * mem_fraction_static)
    if kv_cache_bytes is not None:
        blocks, sized_by = kv_cache_bytes // block_bytes, f"kv_cache_bytes {kv_cache_bytes}"
        fix = "raise kv_cache_bytes"
    elif allowed is not None and allowed < blocks * block_bytes:
        blocks = allowed // block_bytes
        sized_by = f"mem_fraction_static {mem_fraction_static} of {free_bytes} bytes free"
        fix = "raise mem_fraction_static or give kv_cache_bytes"
    if blocks < one_request:
        raise ValueError(
            f"the KV pool ({sized_by}) holds {max(blocks - 1, 0) * block_size} tokens, fewer "
            f"than one request of max_model_len {max_model_len}, which needs "
            f"{one_request * block_bytes} bytes ({token_bytes} bytes a token, one scratch "
            f"block): {fix}, or lower max_model_len"
        )
    return blocks


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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros of ``shape``; on CPU backed by ``calloc``, committed page by page on first
    write (``torch.zeros`` writes every byte, making the whole pool resident at once)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
