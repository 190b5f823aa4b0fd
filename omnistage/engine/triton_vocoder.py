"""Triton kernels of the causal vocoder's layers (CUDA only; imported lazily by
:mod:`omnistage.engine.causal_vocoder`).

:func:`snake_beta_triton`: ``y = x + sin(x * e^alpha)^2 / (e^beta + eps)`` per channel
(SnakeBeta of BigVGAN, Lee et al. 2023, arXiv:2206.04658, with log-scale parameters; the
formula and ``eps`` of :class:`~omnistage.engine.causal_vocoder.SnakeBeta`), computed in
fp32 from one read of ``x`` and one write of ``y``. PyTorch's eager form is eight launches
(two ``exp`` and the ``+ eps`` over the ``[C]`` parameters, then multiply, sine, square,
divide and add over ``x``), each over the whole tensor, and the non-contiguous input a causal
transposed conv hands on (a slice of its output) keeps them off the vectorized path.
Measured on the H200 (``benchmarks/gpu_share.py``, both trees in one call:
``benchmarks/results/gpu_share_before.json``, ``..._snake.json``; the measured tree also
padded the 96 -> 1 output conv, since taken out: benchmarks/README.md, "Device runs of
2026-12-03"), one graph replay of the Qwen3-TTS decoder at 128 streams x 8 frames: 73.8 ms
before, 52.4 ms after; 16 x 8: 13.0 -> 9.8 ms. Shapes are static, so it can be captured in
a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from omnistage.engine.causal_vocoder import FUSED_SNAKE_DTYPES

MAX_BLOCK = 1024  # samples per program


@triton.jit
def _snake_beta_kernel(
    x_ptr,
    alpha_ptr,
    beta_ptr,
    out_ptr,
    channels,
    length,
    stride_b,
    stride_c,
    stride_l,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one (batch, channel) row of [B, C, L]
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < length
    batch, channel = row // channels, row % channels
    x = tl.load(x_ptr + batch * stride_b + channel * stride_c + offsets * stride_l, mask=inside).to(
        tl.float32
    )
    alpha = tl.exp(tl.load(alpha_ptr + channel).to(tl.float32))
    inverse = 1.0 / (tl.exp(tl.load(beta_ptr + channel).to(tl.float32)) + eps)
    wave = libdevice.sin(x * alpha)  # the accurate sine: |x * alpha| is not kept small
    tl.store(
        out_ptr + row * length + offsets,
        (x + wave * wave * inverse).to(out_ptr.dtype.element_ty),
        mask=inside,
    )


def snake_beta_triton(
    x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, eps: float
) -> torch.Tensor:
    """SnakeBeta of ``x [B, C, L]`` (any strides; CUDA; fp32, bf16 or fp16) with log-scale
    ``alpha``, ``beta`` ``[C]`` (on ``x``'s device) -> a contiguous ``[B, C, L]`` of ``x``'s
    dtype, computed in fp32. No autograd: the caller uses it without gradients.

    Raises:
        ValueError: ``x`` is not 3-D or of another dtype, or ``alpha`` / ``beta`` are not
            ``[C]`` on ``x``'s device.
    """
    channels = x.shape[1] if x.dim() == 3 else -1
    if (
        x.dim() != 3
        or x.dtype not in FUSED_SNAKE_DTYPES
        or any(p.shape != (channels,) or p.device != x.device for p in (alpha, beta))
    ):
        raise ValueError(
            f"SnakeBeta needs x [B, C, L] of {FUSED_SNAKE_DTYPES} and alpha, beta [C] on its device; got "
            f"x {tuple(x.shape)} {x.dtype} on {x.device}, alpha {tuple(alpha.shape)} on "
            f"{alpha.device}, beta {tuple(beta.shape)} on {beta.device}"
        )
    batch, _, length = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(length))
    grid = (batch * channels, triton.cdiv(length, block))
    with torch.cuda.device(x.device):
        _snake_beta_kernel[grid](
            x, alpha.contiguous(), beta.contiguous(), out, channels, length, *x.stride(), eps,
            BLOCK=block,
        )  # fmt: skip
    return out
