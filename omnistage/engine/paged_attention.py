"""The paged attention backend: the attention contract of :mod:`omnistage.engine.attention`
over a :class:`~omnistage.engine.kv_cache.PagedKVCache`.

Two kinds of forward, announced by the runner before the first layer:

- prefill (:meth:`PagedAttention.prepare_prefill`): whole prompts of several requests,
  concatenated (variable lengths); each new token attends causally within its own
  sequence. There is no cached prefix yet (no prefix caching), so attention needs only
  the new tokens: one causal SDPA call per sequence. (One call with a block-diagonal
  ``[N, N]`` mask was simpler, but a mask sends SDPA to its math path, which materializes
  ``Hq x N x N`` scores: at 64 coalesced voice-clone prompts, ~6,400 tokens, that ran an
  H200 out of memory.)
- decode (:meth:`PagedAttention.prepare_decode`): one new token per sequence, attending to
  its whole cached context through its block table.

Either way every layer first writes its new ``k, v`` at the tokens' slots. Decode attention
has a plain PyTorch reference (:func:`paged_decode_reference`, used on CPU and as the test
oracle) and a Triton kernel (:mod:`omnistage.engine.triton_decode`) used on CUDA;
:func:`decode_attention_for` picks one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from omnistage.engine.kv_cache import PagedKVCache

# (q [B, Hq, D], k_cache [S, Hkv, D], v_cache [S, Hkv, D], block_tables [B, MB] int64,
#  context_lens [B] int64, block_size) -> [B, Hq, D]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Decode attention by gathering each sequence's keys into a padded batch.

    Args:
        q: ``[B, Hq, D]``, one query token per sequence.
        k_cache, v_cache: ``[S, Hkv, D]``, one layer of the pool (``S`` slots).
        block_tables: ``[B, MB] int64``; entries past a sequence's blocks are ignored.
        context_lens: ``[B] int64``, tokens each sequence attends to (its new one included).
        block_size: tokens per block.

    Returns:
        ``[B, Hq, D]``: softmax(q k^T / sqrt(D)) v over each sequence's first
        ``context_len`` tokens (grouped-query: query head h reads kv head h // (Hq/Hkv)).
    """
    offsets = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    slots = block_tables[:, offsets // block_size] * block_size + offsets % block_size  # [B, L]
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[slots].transpose(1, 2)
    mask = (offsets[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1]
    )
    return out[:, :, 0, :]


def varlen_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Causal attention of concatenated sequences: q ``[N, Hq, D]``, k/v ``[N, Hkv, D]``,
    ``seq_lens`` summing to ``N``; returns ``[N, Hq, D]``. Memory is linear in each
    sequence's length (SDPA's fused kernels with ``is_causal``)."""
    gqa = k.shape[1] != q.shape[1]
    outs, start = [], 0
    for n in seq_lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa).transpose(0, 1))
        start += n
    return torch.cat(outs)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def decode_attention_for(device: torch.device, use_triton: bool | None = None) -> DecodeAttention:
    """The decode attention for ``device``: the Triton kernel on CUDA when Triton is
    installed (``use_triton=None``), else the PyTorch reference.

    Raises:
        ValueError: ``use_triton=True`` on a CPU device or without Triton installed.
    """
    if use_triton is None:
        use_triton = device.type == "cuda" and triton_available()
    if not use_triton:
        return paged_decode_reference
    if device.type != "cuda" or not triton_available():
        raise ValueError(f"the Triton decode kernel needs CUDA and triton (device {device})")
    from omnistage.engine.triton_decode import paged_decode_triton

    return paged_decode_triton


class PagedAttention:
    """The attention backend over a paged pool (see the module docstring).

    Args:
        cache: the pool.
        decode_attention: from :func:`decode_attention_for`.
    """

    def __init__(self, cache: PagedKVCache, decode_attention: DecodeAttention) -> None:
        self.cache = cache
        self.decode_attention = decode_attention
        self._slots = torch.empty(0, dtype=torch.int64)
        self._seq_lens: list[int] | None = None  # set for a prefill forward
        self._block_tables = self._context_lens = self._slots

    def prepare_prefill(self, slot_mapping: torch.Tensor, seq_lens: list[int]) -> None:
        """A prefill forward of ``N`` tokens: ``slot_mapping [N] int64`` and the lengths of
        its sequences (host ints summing to ``N``, in token order)."""
        self._slots = slot_mapping
        self._seq_lens = list(seq_lens)

    def prepare_decode(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """A decode forward of ``B`` tokens, one per sequence: ``slot_mapping [B]``,
        ``block_tables [B, MB]``, ``context_lens [B]`` (all int64, the new token counted)."""
        # contiguous once per forward, not once per layer in the Triton kernel's wrapper
        # (the runner passes a column of its [B, 3] step index)
        self._slots, self._block_tables = slot_mapping, block_tables.contiguous()
        self._context_lens = context_lens.contiguous()
        self._seq_lens = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache.index_copy_(0, self._slots, k)
        v_cache.index_copy_(0, self._slots, v)
        if self._seq_lens is not None:
            return varlen_prefill_attention(q, k, v, self._seq_lens)
        return self.decode_attention(
            q, k_cache, v_cache, self._block_tables, self._context_lens, self.cache.block_size
        )
