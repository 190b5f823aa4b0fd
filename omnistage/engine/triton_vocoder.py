"""Triton kernels of the causal vocoder's layers (CUDA only; imported lazily by
:mod:`omnistage.engine.causal_vocoder`): SnakeBeta, and a residual unit's skip connection
with its conv's bias (:func:`residual_add_triton`).

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

from omnistage.engine.paged_attention import TRITON_DTYPES

MAX_BLOCK = 1024  # samples per program


@triton.jit
def _snake_beta_kernel(
    x_ptr,
    bias_ptr,
    past_ptr,
    alpha_ptr,
    beta_ptr,
    out_ptr,
    channels,
    length,
    history,
    out_length,
    stride_b,
    stride_c,
    stride_l,
    past_stride_b,
    past_stride_c,
    past_stride_l,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_PAST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one (batch, channel) row of the output [B, C, history + length + zeros]: the past's
    # samples, then SnakeBeta of x's, then zeros
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < out_length
    batch, channel = row // channels, row % channels
    at = offsets - history  # the sample of x
    in_x = inside & (at >= 0) & (at < length)
    x = tl.load(x_ptr + batch * stride_b + channel * stride_c + at * stride_l, mask=in_x, other=0.0)
    x = x.to(tl.float32)
    if HAS_BIAS:  # the preceding conv's bias, folded in (x is then its output without bias)
        x += tl.load(bias_ptr + channel).to(tl.float32)
    alpha = tl.exp(tl.load(alpha_ptr + channel).to(tl.float32))
    inverse = 1.0 / (tl.exp(tl.load(beta_ptr + channel).to(tl.float32)) + eps)
    wave = libdevice.sin(x * alpha)  # the accurate sine: |x * alpha| is not kept small
    y = tl.where(in_x, x + wave * wave * inverse, 0.0)
    if HAS_PAST:
        in_past = inside & (offsets < history)
        past = tl.load(
            past_ptr + batch * past_stride_b + channel * past_stride_c + offsets * past_stride_l,
            mask=in_past,
            other=0.0,
        )
        y = tl.where(in_past, past.to(tl.float32), y)
    tl.store(out_ptr + row * out_length + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)


def _check(x: torch.Tensor, name: str, **channel_params: torch.Tensor | None) -> None:
    """Raise the kernels' ValueError unless ``x`` is ``[B, C, L]`` of a fused dtype and every
    given parameter is ``[C]`` on ``x``'s device."""
    channels = x.shape[1] if x.dim() == 3 else -1
    given = {k: p for k, p in channel_params.items() if p is not None}
    if (
        x.dim() != 3
        or x.dtype not in TRITON_DTYPES
        or any(p.shape != (channels,) or p.device != x.device for p in given.values())
    ):
        params = ", ".join(f"{k} {tuple(p.shape)} on {p.device}" for k, p in given.items())
        raise ValueError(
            f"{name} needs x [B, C, L] of {TRITON_DTYPES} and {', '.join(given)} [C] on its "
            f"device; got x {tuple(x.shape)} {x.dtype} on {x.device}, {params}"
        )


def _grid(out: torch.Tensor) -> tuple[int, tuple[int, int]]:
    """The block (samples per program) and grid ``(rows, blocks per row)`` of a kernel that
    writes ``out [B, C, L]``, one program per block of a row."""
    batch, channels, length = out.shape
    block = min(MAX_BLOCK, triton.next_power_of_2(length))
    return block, (batch * channels, triton.cdiv(length, block))


def snake_beta_triton(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    past: torch.Tensor | None = None,
    zeros: int = 0,
) -> torch.Tensor:
    """SnakeBeta of ``x [B, C, L]`` (+ ``bias [C]`` per channel first, when given: a preceding
    conv's bias folded in; any strides; CUDA; fp32, bf16 or fp16) with log-scale ``alpha``,
    ``beta`` ``[C]`` (on ``x``'s device), computed in fp32 -> a contiguous tensor of ``x``'s
    dtype: ``[B, C, L]``, or with ``past [B, C, H]`` (any strides, ``x``'s dtype) and
    ``zeros``, ``cat([past, snake(x), zeros])`` ``[B, C, H + L + zeros]``: a causal conv's
    input with its carried history (and right padding) in the same pass, instead of a
    concatenation's copy after it. No autograd: the caller uses it without gradients.

    Raises:
        ValueError: ``x`` is not 3-D or of another dtype, ``alpha`` / ``beta`` / ``bias`` are
            not ``[C]`` on ``x``'s device, ``past`` is not ``[B, C, H]`` like ``x``, or
            ``zeros < 0``.
    """
    _check(x, "SnakeBeta", alpha=alpha, beta=beta, bias=bias)
    if zeros < 0 or past is not None and (
        past.dim() != 3 or past.shape[:2] != x.shape[:2] or past.dtype != x.dtype or past.device != x.device
    ):
        raise ValueError(
            f"SnakeBeta needs past [B, C, H] like x {tuple(x.shape)} {x.dtype} and zeros >= 0; got "
            f"{None if past is None else (tuple(past.shape), past.dtype, past.device)}, {zeros}"
        )
    history = 0 if past is None else past.shape[-1]
    out = x.new_empty(*x.shape[:2], history + x.shape[-1] + zeros)
    if out.numel() == 0:
        return out
    block, grid = _grid(out)
    with torch.cuda.device(x.device):
        _snake_beta_kernel[grid](
            x, alpha if bias is None else bias.contiguous(), x if past is None else past,
            alpha.contiguous(), beta.contiguous(), out, x.shape[1], x.shape[2], history,
            out.shape[2], *x.stride(), *(x if past is None else past).stride(), eps,
            HAS_BIAS=bias is not None, HAS_PAST=past is not None, BLOCK=block,
        )  # fmt: skip
    return out


@triton.jit
def _residual_kernel(
    residual_ptr,
    y_ptr,
    bias_ptr,
    out_ptr,
    channels,
    length,
    r_stride_b,
    r_stride_c,
    r_stride_l,
    y_stride_b,
    y_stride_c,
    y_stride_l,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one (batch, channel) row of [B, C, L]
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < length
    batch, channel = row // channels, row % channels
    r = tl.load(
        residual_ptr + batch * r_stride_b + channel * r_stride_c + offsets * r_stride_l, mask=inside
    ).to(tl.float32)
    y = tl.load(y_ptr + batch * y_stride_b + channel * y_stride_c + offsets * y_stride_l, mask=inside)
    b = tl.load(bias_ptr + channel).to(tl.float32)
    tl.store(
        out_ptr + row * length + offsets,
        (r + (y.to(tl.float32) + b)).to(out_ptr.dtype.element_ty),
        mask=inside,
    )


def residual_add_triton(
    residual: torch.Tensor, y: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """``residual + (y + bias)`` per channel, for ``residual``, ``y [B, C, L]`` (any strides;
    CUDA; one fused dtype) and ``bias [C]``: a residual unit's skip connection with its last
    conv's bias folded in (``y`` is that conv's output without bias), one read of each and
    one write, in fp32 -> a contiguous ``[B, C, L]`` of ``residual``'s dtype. Without the
    fold these are two passes: PyTorch's broadcast bias add after the conv (0.61 ms after
    the Qwen3-TTS decoder's 96-channel 1x1 conv at 128 streams x 8 frames on the H100,
    whose own kernel took 0.29 ms: benchmarks/results/vocoder_convs.json) and the residual
    add.

    Raises:
        ValueError: the tensors are not 3-D of one shape and fused dtype, or ``bias`` is not
            ``[C]`` on their device.
    """
    _check(residual, "residual add", bias=bias)
    if y.shape != residual.shape or y.dtype != residual.dtype or y.device != residual.device:
        raise ValueError(
            f"residual add needs y like the residual {tuple(residual.shape)} {residual.dtype} "
            f"on {residual.device}; got {tuple(y.shape)} {y.dtype} on {y.device}"
        )
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    if out.numel() == 0:
        return out
    block, grid = _grid(residual)
    with torch.cuda.device(residual.device):
        _residual_kernel[grid](
            residual, y, bias.contiguous(), out, residual.shape[1], residual.shape[2],
            *residual.stride(), *y.stride(), BLOCK=block,
        )  # fmt: skip
    return out
