"""The attention contract between model code and whoever owns the KV cache.

Model layers never own a KV cache. Each attention layer computes ``q, k, v`` for the new
tokens of a forward (after its projections, q/k norms and RoPE) and calls the backend it
was given::

    out = attn(layer_index, q, k, v)   # q [N, Hq, D]; k, v [N, Hkv, D] -> out [N, Hq, D]

``N`` is the number of new tokens of this forward, flattened over the batch in sequence
order. The backend stores ``k, v`` in its cache and returns, for every new token, causal
attention over its own sequence's cached and new keys (grouped-query: ``Hq`` is a multiple
of ``Hkv``; scale ``1/sqrt(D)``). Who drives the forward calls the backend's ``prepare``
first with the batch layout; the backend then serves every layer of that forward.

Backends: :class:`DenseKVCache` (this file: equal-length sequences in one contiguous
buffer; the unbatched reference loops and the code predictor's per-frame cache) and the
engine's paged backend (block tables, variable lengths).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k, v`` for ``layer`` and attend; shapes in the module docstring."""


class DenseKVCache:
    """KV cache for ``batch`` sequences that always have the same length.

    Buffers ``k, v``: ``[num_layers, batch, max_len, num_kv_heads, head_dim]``. A forward of
    ``n`` new tokens per sequence passes ``N = batch * n`` tokens, batch-major (sequence 0's
    ``n`` tokens first). Call :meth:`prepare` once per forward, before its first layer.

    With ``fused_decode`` (the code predictor's per-frame caches), a forward of one token
    per sequence (its 14 sub-steps after the first) runs, on CUDA for what
    :func:`~omnistage.engine.layers.dense_decode_fits` accepts, as one Triton kernel that
    writes ``k, v`` and attends
    (:func:`~omnistage.engine.triton_layers.dense_decode_attention_triton`) instead of two
    copies and an SDPA call. In a Qwen3-TTS frame at batch 128 on an H100
    (``benchmarks/results/gpu_share_layers.json``, 1,647 launches and 8.9 ms of kernels)
    those sub-steps' SDPA calls were 70 launches and 0.89 ms, and their cache writes 140 of
    the frame's 150 copy kernels (0.35 ms for the 150). Everything else, and the CPU, runs
    the PyTorch form below.

    Args:
        num_layers, batch, max_len, num_kv_heads, head_dim: buffer geometry.
        dtype, device: of the buffers (and of the q/k/v passed in).
        fused_decode: one-token forwards through the dense decode kernel where it fits
            (off: always the PyTorch form, as the reference loops keep it).

    Raises:
        ValueError (from :meth:`prepare`): the forward would exceed ``max_len``.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fused_decode: bool = False,
    ) -> None:
        self.fused_decode = fused_decode
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.max_len = batch, max_len
        self.length = 0  # tokens per sequence already cached before the current forward
        self._start = 0
        self._new = 0

    def reset(self) -> None:
        """Forget every cached token (buffers are reused, not cleared)."""
        self.length = self._start = self._new = 0

    def prepare(self, num_new: int) -> None:
        """Announce a forward of ``num_new`` tokens per sequence."""
        if self.length + num_new > self.max_len:
            raise ValueError(f"DenseKVCache holds {self.max_len} tokens; asked for {self.length + num_new}")
        self._start, self._new = self.length, num_new
        self.length += num_new

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, start = self.batch, self._new, self._start
        end = start + n
        # a decode token per sequence (the predictor's sub-steps); the CPU (the engine's
        # every sub-step there too) skips the shape checks
        if n == 1 and self.fused_decode and q.is_cuda:
            from omnistage.engine import layers  # it imports this module

            k_cache, v_cache = self.k[layer], self.v[layer]
            if layers.dense_decode_fits(q, k, v, k_cache, v_cache) and layers.triton_runs(q, k, v):
                from omnistage.engine.triton_layers import dense_decode_attention_triton

                return dense_decode_attention_triton(q, k, v, k_cache, v_cache, start)
        self.k[layer, :, start:end] = k.view(b, n, *k.shape[1:])
        self.v[layer, :, start:end] = v.view(b, n, *v.shape[1:])
        # [B, H, L, D] layout for SDPA
        qb = q.view(b, n, *q.shape[1:]).transpose(1, 2)
        kb = self.k[layer, :, :end].transpose(1, 2)
        vb = self.v[layer, :, :end].transpose(1, 2)
        # causal with an offset: new token i sees cached keys [0, start + i]. The code
        # predictor's forwards need no mask tensor (building one is 2-4 kernels per layer, and
        # on CUDA a mask rules out flash attention): one new token sees everything cached,
        # and a first forward is plainly causal.
        mask = None
        if n > 1 and start > 0:
            mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, is_causal=n > 1 and start == 0, enable_gqa=kb.shape[1] != qb.shape[1]
        )
        return out.transpose(1, 2).reshape(b * n, *q.shape[1:])
