"""Triton kernels of the Qwen3 decoder layers (CUDA only; imported lazily by
:mod:`omnistage.engine.layers` and :mod:`omnistage.engine.attention`): RMSNorm with its
weight (optionally after a residual add), the per-head q/k RMSNorm with rotary position
embedding, SwiGLU's ``silu(gate) * up``, and one decode token's attention over a dense KV
cache with its write (the code predictor's sub-steps; its rounding is its own docstring's).

An AR decode step is many small kernels: at the Qwen3-TTS 0.6B sizes one frame was 2,693
launches and 12.35 ms of kernel time at batch 128 on an H100, 4.6 us a launch on average
(``benchmarks/results/gpu_share_phases.json``). Of that, the elementwise, layer-norm and
roll kernels that these replace were about 1,640 launches and 4.3 ms; paged decode, SDPA and
the GEMMs about 6.6 ms. In PyTorch's form one layer launched 21 kernels; with these it
launches 11 (:class:`~omnistage.engine.layers.DecoderLayer`; ``benchmarks/step_kernels.py``
counts them): each RMSNorm with its weight and the residual add before it 3 -> 1 (twice),
the q/k norms with RoPE 6 -> 1 (``rms_norm``, the weight, ``x * cos``, ``roll``,
``* sin``, ``+``), SwiGLU 2 -> 1.

In bf16 and fp16 each kernel rounds where PyTorch's ops round: every intermediate that
PyTorch writes in the input dtype is rounded to it here too (the RMSNorm output before its
weight, the weight product, each RoPE product, the residual sum, ``silu`` before the
product), all arithmetic in fp32 (PyTorch's opmath), products and sums kept apart (no fused
multiply-add), divisions correctly rounded, ``exp`` libdevice's ``expf`` (the function
PyTorch's CUDA ``silu`` calls). What differs is the order of the mean square's sum and the
fp32 ``rsqrt``: a row's scale may differ from PyTorch's in its last fp32 bit, which flips
the rounding of an element now and then (and, where RoPE's two products cancel, by more than
one unit of that element; not of the row). In fp32 there is no intermediate rounding to
match, and the results differ in the last bits the same way. Shapes are static, so the
kernels can be captured in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from omnistage.engine.layers import dense_decode_fits, qk_norm_rope_fits, rms_norm_fits, swiglu_fits
from omnistage.engine.paged_attention import TRITON_DTYPES

SWIGLU_BLOCK = 1024  # columns per program


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_delta,
    stride_out,
    stride_sum,
    cols,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one row: [x + delta ->] RMSNorm -> * weight
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < cols
    x = tl.load(x_ptr + row * stride_x + offsets, mask=inside, other=0.0)
    if HAS_DELTA:  # the residual sum, rounded to the input dtype as PyTorch's add writes it
        delta = tl.load(delta_ptr + row * stride_delta + offsets, mask=inside, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + offsets, x, mask=inside)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.math.div_rn(tl.sum(xf * xf, 0), cols.to(tl.float32)) + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offsets, (normed * weight).to(x.dtype), mask=inside)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_token,
    stride_head,
    stride_cos,
    stride_sin,
    eps,
    HALF: tl.constexpr,
):
    # one (token, head) row of D = 2 HALF, in place: RMSNorm -> * weight -> rotate-half RoPE
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF)
    row = qkv_ptr + token * stride_token + head * stride_head
    x1 = tl.load(row + dims)
    x2 = tl.load(row + HALF + dims)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # times 1 / D: exact, D a power of two (the mean square as PyTorch divides it)
    rstd = tl.math.rsqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) * (1.0 / (2 * HALF)) + eps)
    w1 = tl.load(weight_ptr + head * 2 * HALF + dims).to(tl.float32)
    w2 = tl.load(weight_ptr + head * 2 * HALF + HALF + dims).to(tl.float32)
    n1 = ((f1 * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
    n2 = ((f2 * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    c1 = tl.load(cos_ptr + token * stride_cos + dims).to(tl.float32)
    c2 = tl.load(cos_ptr + token * stride_cos + HALF + dims).to(tl.float32)
    s1 = tl.load(sin_ptr + token * stride_sin + dims).to(tl.float32)  # -sin
    s2 = tl.load(sin_ptr + token * stride_sin + HALF + dims).to(tl.float32)  # +sin
    # x * cos + roll(x, HALF) * signed_sin, each product rounded as PyTorch writes it
    o1 = (n1 * c1).to(x1.dtype).to(tl.float32) + (n2 * s1).to(x1.dtype).to(tl.float32)
    o2 = (n2 * c2).to(x1.dtype).to(tl.float32) + (n1 * s2).to(x1.dtype).to(tl.float32)
    tl.store(row + dims, o1.to(x1.dtype))
    tl.store(row + HALF + dims, o2.to(x1.dtype))


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, stride_x, stride_out, cols, BLOCK: tl.constexpr):
    # silu(gate) * up for one block of a row of [gate | up]
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < cols
    gate = tl.load(x_ptr + row * stride_x + offsets, mask=inside, other=0.0)
    up = tl.load(x_ptr + row * stride_x + cols + offsets, mask=inside, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offsets, (silu * up).to(gate.dtype), mask=inside)


@triton.jit(do_not_specialize=["position"])  # one compile for every position
def _dense_decode_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    position, scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_cb, stride_cl, stride_ch, stride_vcb, stride_vcl, stride_vch, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    # one program per (sequence, KV head): its GROUP query heads attend over positions
    # 0..position, the new k/v (at position) written to the caches and used from registers
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, D)
    slots = tl.arange(0, BLOCK_L)
    heads = tl.arange(0, BLOCK_G)
    k_new = tl.load(k_ptr + seq * stride_kb + head * stride_kh + dims)
    v_new = tl.load(v_ptr + seq * stride_vb + head * stride_vh + dims)
    tl.store(k_cache_ptr + seq * stride_cb + position * stride_cl + head * stride_ch + dims, k_new)
    tl.store(v_cache_ptr + seq * stride_vcb + position * stride_vcl + head * stride_vch + dims, v_new)
    past = (slots < position)[:, None]
    keys = tl.load(
        k_cache_ptr + seq * stride_cb + slots[:, None] * stride_cl + head * stride_ch + dims[None, :],
        mask=past, other=0.0,
    )
    values = tl.load(
        v_cache_ptr + seq * stride_vcb + slots[:, None] * stride_vcl + head * stride_vch + dims[None, :],
        mask=past, other=0.0,
    )
    now = (slots == position)[:, None]
    keys = tl.where(now, k_new[None, :], keys).to(tl.float32)
    values = tl.where(now, v_new[None, :], values).to(tl.float32)
    in_group = (heads < GROUP)[:, None]
    q_heads = head * GROUP + heads  # query head i reads KV head i // GROUP (SDPA's enable_gqa)
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :], mask=in_group, other=0.0)
    scores = tl.sum(q.to(tl.float32)[:, None, :] * keys[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_L]
    scores = tl.where((slots <= position)[None, :], scores, float("-inf"))
    weights = libdevice.exp(scores - tl.max(scores, axis=1)[:, None])
    weights = weights / tl.sum(weights, axis=1)[:, None]
    out = tl.sum(weights[:, :, None] * values[None, :, :], axis=1)  # [BLOCK_G, D]
    tl.store(
        out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=in_group,
    )


def _refuse_unless(fits: bool, name: str, rule: Callable[..., bool], **given: torch.Tensor | int | None) -> None:
    """Raise ValueError naming every given tensor's shape, stride, dtype and device (and
    ``rule``, the predicate of the shapes, which also asks for one dtype and device) unless
    ``fits`` and every tensor is on CUDA in :data:`TRITON_DTYPES`."""
    tensors = [t for t in given.values() if isinstance(t, torch.Tensor)]
    if fits and all(t.is_cuda and t.dtype in TRITON_DTYPES for t in tensors):
        return
    described = ", ".join(
        f"{k} {tuple(t.shape)} stride {t.stride()} {t.dtype} on {t.device}"
        if isinstance(t, torch.Tensor)
        else f"{k} {t}"
        for k, t in given.items()
    )
    raise ValueError(
        f"{name} cannot take {described}: the shapes as {rule.__module__}.{rule.__name__} "
        f"says, on CUDA in {TRITON_DTYPES}"
    )


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight * rms_norm(s)`` with ``s = x + delta`` (``s = x`` without ``delta``).

    Args:
        x: ``[N, H]`` (unit inner stride; rows may be strided).
        delta: ``[N, H]``, any strides (copied to unit inner stride when it has none).
        weight: ``[H]``; all three of one dtype and device.
        eps: added to the mean square (the checkpoint's ``rms_norm_eps``).

    Returns:
        ``(normed, s)``, both ``[N, H]`` in ``x``'s dtype: ``normed`` contiguous, ``s`` a
        new contiguous tensor with ``delta`` and ``x`` itself without.

    Raises:
        ValueError: other shapes (:func:`~omnistage.engine.layers.rms_norm_fits`), dtypes or
            devices.
    """
    _refuse_unless(
        rms_norm_fits(x, weight, delta), "rms_norm_triton", rms_norm_fits, x=x, weight=weight, delta=delta
    )
    if delta is not None and delta.stride(-1) != 1:
        delta = delta.contiguous()
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    summed = x if delta is None else torch.empty_like(out)
    if rows == 0:
        return out, summed
    with torch.cuda.device(x.device):  # Triton launches on the current device's stream
        _rms_norm_kernel[(rows,)](
            x, x if delta is None else delta, weight, out, summed,
            x.stride(0), 0 if delta is None else delta.stride(0), out.stride(0), summed.stride(0),
            cols, eps, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(cols),
            enable_fp_fusion=False,
        )  # fmt: skip
    return out, summed


def qk_norm_rope_triton_(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    eps: float,
    heads: int,
) -> None:
    """In place on the first ``heads`` heads of ``qkv``: per-head RMSNorm times
    ``weight[h]``, then rotate-half RoPE (``x * cos + roll(x, D/2) * signed_sin``, the form
    of :func:`omnistage.engine.layers.apply_rope`). The other heads (v) are left as they are.

    Args:
        qkv: ``[N, heads_total, D]`` (``D`` a power of two >= 2; unit inner stride).
        weight: ``[heads_total, D]`` (the q heads' norm weight, then the k heads'; rows past
            ``heads`` unread).
        cos, signed_sin: ``[N, D]`` (unit inner stride), ``qkv``'s dtype.
        eps: the norms' ``rms_norm_eps``.
        heads: how many leading heads to normalize and rotate (q and k).

    Raises:
        ValueError: other shapes (:func:`~omnistage.engine.layers.qk_norm_rope_fits`), dtypes
            or devices.
    """
    _refuse_unless(
        qk_norm_rope_fits(qkv, weight, cos, signed_sin, heads), "qk_norm_rope_triton_", qk_norm_rope_fits,
        qkv=qkv, weight=weight, cos=cos, signed_sin=signed_sin, heads=heads,
    )  # fmt: skip
    n, _, dim = qkv.shape
    if n == 0:
        return
    with torch.cuda.device(qkv.device):
        _qk_norm_rope_kernel[(n, heads)](
            qkv, weight, cos, signed_sin, qkv.stride(0), qkv.stride(1), cos.stride(0),
            signed_sin.stride(0), eps, HALF=dim // 2, enable_fp_fusion=False,
        )  # fmt: skip


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]``: ``[N, 2 I]`` (unit inner stride)
    -> ``[N, I]`` contiguous, same dtype (SwiGLU, Shazeer 2020, as Qwen3's MLP computes it).

    Raises:
        ValueError: other shapes (:func:`~omnistage.engine.layers.swiglu_fits`), dtypes or
            devices.
    """
    _refuse_unless(swiglu_fits(gate_up), "swiglu_triton", swiglu_fits, gate_up=gate_up)
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or cols == 0:
        return out
    block = min(SWIGLU_BLOCK, triton.next_power_of_2(cols))
    with torch.cuda.device(gate_up.device):
        _swiglu_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=block, enable_fp_fusion=False
        )
    return out


def dense_decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    position: int,
) -> torch.Tensor:
    """One decode token per sequence over one layer's dense KV cache, in one kernel: ``k``
    and ``v`` are written at ``position`` of ``k_cache`` and ``v_cache``, and each query
    head attends over positions ``0..position`` of its KV head (scale ``1/sqrt(D)``, query
    head ``i`` on KV head ``i // (Hq / Hkv)``), as
    :class:`~omnistage.engine.attention.DenseKVCache` computes it with two copies and SDPA.

    The scores, softmax and weighted sum are fp32; the output is rounded to the input dtype
    once (SDPA's kernels round the softmax weights too, so bf16 results differ in the last
    bits).

    Args:
        q: ``[B, Hq, D]``.
        k, v: ``[B, Hkv, D]``, the new token's.
        k_cache, v_cache: ``[B, L, Hkv, D]``, one layer's buffers (written at ``position``).
        position: ``0 <= position < L``.

    Returns:
        ``[B, Hq, D]`` contiguous, ``q``'s dtype.

    Raises:
        ValueError: other shapes (:func:`~omnistage.engine.layers.dense_decode_fits`), a
            position outside the cache, dtypes or devices.
    """
    fits = dense_decode_fits(q, k, v, k_cache, v_cache) and 0 <= position < k_cache.shape[1]
    _refuse_unless(
        fits, "dense_decode_attention_triton", dense_decode_fits,
        q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, position=position,
    )  # fmt: skip
    batch, num_heads, dim = q.shape
    length, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((batch, num_heads, dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    with torch.cuda.device(q.device):
        _dense_decode_kernel[(batch, num_kv_heads)](
            q, k, v, k_cache, v_cache, out, position, dim**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=triton.next_power_of_2(group), D=dim, BLOCK_L=triton.next_power_of_2(length),
        )  # fmt: skip
    return out
