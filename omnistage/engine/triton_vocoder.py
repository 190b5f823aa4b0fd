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

Both kernels take the vocoder's two layouts (:mod:`omnistage.engine.causal_vocoder`): ``[B,
C, L]`` (one program per block of a ``(batch, channel)`` row, the unit stride along ``L``)
and channels-last ``[B, C, 1, L]`` (memory ``[B, L, C]``: one program per tile of
``BLOCK_L`` samples x ``BLOCK_C`` channels, the channel the fastest index, so loads and
stores are coalesced along it and the per-channel parameters are read once a tile). The
tile's size is a first choice, not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from omnistage.engine.causal_vocoder import is_vocoder_layout
from omnistage.engine.paged_attention import TRITON_DTYPES

MAX_BLOCK = 1024  # samples per program; channels-last: elements per tile
MAX_BLOCK_C = 64  # channels of a channels-last tile (128 bytes of bf16 along a sample)


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


@triton.jit
def _cl_tile(channels, out_length, time_blocks, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile of a channels-last ``[B, C, 1, out_length]`` output: its batch,
    samples ``[BLOCK_L, 1]``, channels ``[1, BLOCK_C]``, which channels exist, and which
    elements."""
    pid = tl.program_id(0).to(tl.int64)
    batch, block = pid // time_blocks, pid % time_blocks
    sample = block * BLOCK_L + tl.arange(0, BLOCK_L)[:, None]
    channel = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    in_channels = channel < channels
    return batch, sample, channel, in_channels, in_channels & (sample < out_length)


@triton.jit
def _snake_beta_cl_kernel(
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
    time_blocks,
    stride_b,
    stride_c,
    stride_l,
    past_stride_b,
    past_stride_c,
    past_stride_l,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_PAST: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # _snake_beta_kernel's sums over a tile of the channels-last output [B, C, 1, history +
    # length + zeros] (memory [B, history + length + zeros, C])
    batch, sample, channel, in_channels, inside = _cl_tile(
        channels, out_length, time_blocks, BLOCK_L, BLOCK_C
    )
    at = sample - history  # the sample of x
    in_x = inside & (at >= 0) & (at < length)
    x = tl.load(x_ptr + batch * stride_b + channel * stride_c + at * stride_l, mask=in_x, other=0.0)
    x = x.to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + channel, mask=in_channels, other=0.0).to(tl.float32)
    alpha = tl.exp(tl.load(alpha_ptr + channel, mask=in_channels, other=0.0).to(tl.float32))
    beta = tl.load(beta_ptr + channel, mask=in_channels, other=0.0).to(tl.float32)
    inverse = 1.0 / (tl.exp(beta) + eps)
    wave = libdevice.sin(x * alpha)
    y = tl.where(in_x, x + wave * wave * inverse, 0.0)
    if HAS_PAST:
        in_past = inside & (sample < history)
        past = tl.load(
            past_ptr + batch * past_stride_b + channel * past_stride_c + sample * past_stride_l,
            mask=in_past,
            other=0.0,
        )
        y = tl.where(in_past, past.to(tl.float32), y)
    out = out_ptr + (batch * out_length + sample) * channels + channel
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=inside)


def _check(x: torch.Tensor, name: str, **channel_params: torch.Tensor | None) -> None:
    """Raise the kernels' ValueError unless ``x`` is ``[B, C, L]`` or ``[B, C, 1, L]`` of a
    fused dtype and every given parameter is ``[C]`` on ``x``'s device."""
    layout_ok = is_vocoder_layout(x)
    channels = x.shape[1] if layout_ok else -1
    given = {k: p for k, p in channel_params.items() if p is not None}
    if (
        not layout_ok
        or x.dtype not in TRITON_DTYPES
        or any(p.shape != (channels,) or p.device != x.device for p in given.values())
    ):
        params = ", ".join(f"{k} {tuple(p.shape)} on {p.device}" for k, p in given.items())
        raise ValueError(
            f"{name} needs x [B, C, L] or [B, C, 1, L] of {TRITON_DTYPES} and "
            f"{', '.join(given)} [C] on its device; got x {tuple(x.shape)} {x.dtype} on "
            f"{x.device}, {params}"
        )


def _grid(out: torch.Tensor) -> tuple[int, tuple[int, int]]:
    """The block (samples per program) and grid ``(rows, blocks per row)`` of a kernel that
    writes ``out [B, C, L]``, one program per block of a row."""
    batch, channels, length = out.shape
    block = min(MAX_BLOCK, triton.next_power_of_2(length))
    return block, (batch * channels, triton.cdiv(length, block))


def _cl_grid(out: torch.Tensor) -> tuple[int, int, int, tuple[int, int]]:
    """``(BLOCK_L, BLOCK_C, time_blocks, grid)`` of a kernel that writes the channels-last
    ``out [B, C, 1, L]``: a program per tile of at most :data:`MAX_BLOCK` elements, the grid
    ``(batch x tiles along L, tiles along C)``."""
    batch, channels, _, length = out.shape
    block_c = min(MAX_BLOCK_C, triton.next_power_of_2(channels))
    block_l = min(MAX_BLOCK // block_c, triton.next_power_of_2(length))
    time_blocks = triton.cdiv(length, block_l)
    return block_l, block_c, time_blocks, (batch * time_blocks, triton.cdiv(channels, block_c))


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The batch, channel and sample strides of ``t [B, C, L]`` or ``[B, C, 1, L]``."""
    return t.stride(0), t.stride(1), t.stride(-1)


def _new_output(like: torch.Tensor, length: int) -> torch.Tensor:
    """An uninitialized ``[B, C, length]`` (contiguous) or channels-last ``[B, C, 1, length]``
    of ``like``'s layout, dtype and device."""
    if like.dim() == 3:
        return like.new_empty(*like.shape[:2], length)
    return torch.empty(
        (*like.shape[:3], length),
        dtype=like.dtype,
        device=like.device,
        memory_format=torch.channels_last,
    )


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
    concatenation's copy after it. The same for channels-last ``x [B, C, 1, L]`` and ``past
    [B, C, 1, H]`` (any strides; the channel's unit stride is the fast path) -> a
    channels-last ``[B, C, 1, H + L + zeros]``. No autograd: the caller uses it without
    gradients.

    Raises:
        ValueError: ``x`` is not ``[B, C, L]`` / ``[B, C, 1, L]`` or of another dtype,
            ``alpha`` / ``beta`` / ``bias`` are not ``[C]`` on ``x``'s device, ``past`` is not
            ``[B, C, H]`` / ``[B, C, 1, H]`` like ``x``, or ``zeros < 0``.
    """
    _check(x, "SnakeBeta", alpha=alpha, beta=beta, bias=bias)
    if zeros < 0 or past is not None and (
        past.shape[:-1] != x.shape[:-1] or past.dtype != x.dtype or past.device != x.device
    ):
        raise ValueError(
            f"SnakeBeta needs past [B, C, H] or [B, C, 1, H] like x {tuple(x.shape)} {x.dtype} "
            f"and zeros >= 0; got "
            f"{None if past is None else (tuple(past.shape), past.dtype, past.device)}, {zeros}"
        )
    history = 0 if past is None else past.shape[-1]
    out = _new_output(x, history + x.shape[-1] + zeros)
    if out.numel() == 0:
        return out
    args = (
        x, alpha if bias is None else bias.contiguous(), x if past is None else past,
        alpha.contiguous(), beta.contiguous(), out, x.shape[1], x.shape[-1], history, out.shape[-1],
    )  # fmt: skip
    strides = (*_strides(x), *_strides(x if past is None else past), eps)
    flags = {"HAS_BIAS": bias is not None, "HAS_PAST": past is not None}
    with torch.cuda.device(x.device):
        if x.dim() == 3:
            block, grid = _grid(out)
            _snake_beta_kernel[grid](*args, *strides, **flags, BLOCK=block)
        else:
            block_l, block_c, time_blocks, grid = _cl_grid(out)
            _snake_beta_cl_kernel[grid](
                *args, time_blocks, *strides, **flags, BLOCK_L=block_l, BLOCK_C=block_c
            )
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


@triton.jit
def _residual_cl_kernel(
    residual_ptr,
    y_ptr,
    bias_ptr,
    out_ptr,
    channels,
    length,
    time_blocks,
    r_stride_b,
    r_stride_c,
    r_stride_l,
    y_stride_b,
    y_stride_c,
    y_stride_l,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # _residual_kernel's sum over a tile of the channels-last [B, C, 1, L] (memory [B, L, C])
    batch, sample, channel, in_channels, inside = _cl_tile(
        channels, length, time_blocks, BLOCK_L, BLOCK_C
    )
    r = tl.load(
        residual_ptr + batch * r_stride_b + channel * r_stride_c + sample * r_stride_l, mask=inside
    ).to(tl.float32)
    y = tl.load(
        y_ptr + batch * y_stride_b + channel * y_stride_c + sample * y_stride_l, mask=inside
    )
    b = tl.load(bias_ptr + channel, mask=in_channels, other=0.0).to(tl.float32)
    out = out_ptr + (batch * length + sample) * channels + channel
    tl.store(out, (r + (y.to(tl.float32) + b)).to(out_ptr.dtype.element_ty), mask=inside)


def residual_add_triton(
    residual: torch.Tensor, y: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """``residual + (y + bias)`` per channel, for ``residual``, ``y [B, C, L]`` (any strides;
    CUDA; one fused dtype) and ``bias [C]``: a residual unit's skip connection with its last
    conv's bias folded in (``y`` is that conv's output without bias), one read of each and
    one write, in fp32 -> a contiguous ``[B, C, L]`` of ``residual``'s dtype; for
    channels-last ``[B, C, 1, L]`` inputs a channels-last ``[B, C, 1, L]``. Without the
    fold these are two passes: PyTorch's broadcast bias add after the conv (0.61 ms after
    the Qwen3-TTS decoder's 96-channel 1x1 conv at 128 streams x 8 frames on the H100,
    whose own kernel took 0.29 ms: benchmarks/results/vocoder_convs.json) and the residual
    add.

    Raises:
        ValueError: the tensors are not ``[B, C, L]`` / ``[B, C, 1, L]`` of one shape and
            fused dtype, or ``bias`` is not ``[C]`` on their device.
    """
    _check(residual, "residual add", bias=bias)
    if y.shape != residual.shape or y.dtype != residual.dtype or y.device != residual.device:
        raise ValueError(
            f"residual add needs y like the residual {tuple(residual.shape)} {residual.dtype} "
            f"on {residual.device}; got {tuple(y.shape)} {y.dtype} on {y.device}"
        )
    out = _new_output(residual, residual.shape[-1])
    if out.numel() == 0:
        return out
    args = (residual, y, bias.contiguous(), out, residual.shape[1], residual.shape[-1])
    strides = (*_strides(residual), *_strides(y))
    with torch.cuda.device(residual.device):
        if residual.dim() == 3:
            block, grid = _grid(residual)
            _residual_kernel[grid](*args, *strides, BLOCK=block)
        else:
            block_l, block_c, time_blocks, grid = _cl_grid(out)
            _residual_cl_kernel[grid](
                *args, time_blocks, *strides, BLOCK_L=block_l, BLOCK_C=block_c
            )
    return out
