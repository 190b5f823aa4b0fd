"""Paged decode attention in Triton (CUDA only; imported lazily by
:func:`omnistage.engine.paged_attention.decode_attention_for`).

One program per (sequence, kv head) walks the sequence's context in tiles of ``BLOCK_N``
tokens, gathering each token's slot through the block table, with an online softmax
(FlashAttention, Dao et al. 2022; the "flash decoding" single-query case). The query heads
that share the kv head (grouped-query attention) are one ``[BLOCK_H, D]`` tile, padded to
16 rows so both products run on tensor cores. Same contract and result as
:func:`~omnistage.engine.paged_attention.paged_decode_reference`; shapes are static, so it
can be captured in a CUDA graph.

No split over the context: at TTS context lengths (a few hundred to ~2k tokens) and
batch >= 8 the (batch x kv heads) grid already fills the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(lens_ptr + seq)
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for start in range(0, context, BLOCK_N):
        token = start + cols
        ok = token < context
        block = tl.load(tables_ptr + seq * stride_tb + token // PAGE, mask=ok, other=0)
        slot = block * PAGE + token % PAGE
        kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(row_max - m_new)
        v = tl.load(v_ptr + kv_offsets, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        row_max = m_new
    out = acc / row_sum[:, None]
    tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Same contract as :func:`~omnistage.engine.paged_attention.paged_decode_reference`
    (``head_dim`` a power of two >= 16; fp32 inputs use exact fp32 products, not TF32)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    # the kernel indexes q, the tables' rows and the lengths with unit inner strides; q may
    # be a view of the fused q/k/v heads (strided rows and heads are fine, no copy)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    with torch.cuda.device(q.device):  # Triton launches on the current device's stream
        _paged_decode_kernel[(batch, num_kv_heads)](
            q, k_cache, v_cache, block_tables, context_lens, out, head_dim**-0.5,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=64, PAGE=block_size,
            HEAD_DIM=head_dim, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
    return out
