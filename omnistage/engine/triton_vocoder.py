"""Triton kernels of the causal vocoder's layers (CUDA only; imported lazily by
:mod:`omnistage.engine.causal_vocoder`).

:func:`snake_beta_triton`: ``y = x + sin(x * e^alpha)^2 / (e^beta + eps)`` per channel
(BigVGAN's SnakeBeta, the formula and ``eps`` of
:class:`~omnistage.engine.causal_vocoder.SnakeBeta`), in fp32 from one read of ``x`` and one
write of ``y``. PyTorch's eager form is five kernels (multiply, sine, square, divide, add),
each reading and writing the whole tensor, and the non-contiguous input a causal transposed
conv hands on (a slice of its output) keeps them off the vectorized path. Measured on the
H200 (``benchmarks/gpu_share.py``, both trees in one call:
``benchmarks/results/gpu_share_before.json``, ``..._snake.json``), one graph replay of the
Qwen3-TTS decoder at 128 streams x 8 frames: 73.8 ms before, 52.4 ms with this kernel; 16 x
8: 13.0 -> 9.8 ms. Shapes are static, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

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
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
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
    """SnakeBeta of ``x [B, C, L]`` (any strides, CUDA) with log-scale ``alpha``, ``beta``
    ``[C]`` -> a contiguous ``[B, C, L]`` of ``x``'s dtype.

    Raises:
        ValueError: ``x`` is not 3-D or ``alpha`` / ``beta`` are not ``[C]``.
    """
    if x.dim() != 3 or alpha.shape != (x.shape[1],) or beta.shape != (x.shape[1],):
        raise ValueError(
            f"SnakeBeta needs x [B, C, L] and alpha, beta [C]; got {tuple(x.shape)}, "
            f"{tuple(alpha.shape)}, {tuple(beta.shape)}"
        )
    batch, channels, length = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(length))
    grid = (batch * channels, triton.cdiv(length, block))
    _snake_beta_kernel[grid](
        x, alpha, beta, out, channels, length, *x.stride(), eps, BLOCK=block,
    )  # fmt: skip
    return out

