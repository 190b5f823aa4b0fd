"""Causal vocoder layers with carried state: code-frame latents -> 24 kHz PCM, offline or
one chunk at a time (Qwen3-TTS's speech tokenizer decoder and Qwen3-Omni's code2wav share
them: the same upsampler, vocoder blocks and sliding-window transformer).

Architecture (shared/reference/qwen3-tts.md, section 6; weight names are the checkpoints'):
an optional sliding-window transformer (72 frames, RoPE, LayerScale) -> 2 x [transposed
conv k2 s2 + ConvNeXt] -> causal conv k7 ``latent -> decoder_dim`` -> one block per
vocoder rate (SnakeBeta, transposed conv k=2r s=r, 3 residual units with dilations
1/3/9) -> SnakeBeta -> conv k7 -> 1 channel -> clamp [-1, 1]. 1920 samples per frame for
rates 8, 5, 4, 3 after 2 x 2.

Every layer is causal, so one implementation serves offline and streaming decoding: each
layer that looks back (the causal convs with k > 1, the transformer's KV window, the
transposed convs whose kernel outlasts their stride) reads its carried state from a flat
list and writes the updated state to another (:class:`Carry`). Offline decoding is
streaming from a zero state: the zero history is exactly the causal convs' left zero
padding, and the masked-out KV window is what the sliding-window mask removes. So a prefix
decodes to a prefix of the full decode, and chunked decoding with carried state
concatenates to the offline decode.

A model subclasses :class:`CarriedStateVocoder` with its latent path
(:meth:`CarriedStateVocoder.latents`) and may declare samples that open every stream
without being audio (:attr:`CarriedStateVocoder.leading_trim`).

Two layouts of the activations between layers (one switch:
:meth:`CarriedStateVocoder.to_channels_last`): ``[B, C, L]`` (NCL, the default), or
channels-last: ``[B, C, 1, L]`` tensors in ``torch.channels_last`` memory format (memory
order ``[B, L, C]``; 4-D because PyTorch has no channels-last format for 3-D tensors, so
``cat``, ``empty_like`` and elementwise ops would hand back NCL). Channels-last, the convs
are 2-D convs of kernel ``(1, k)`` with weights laid out once, so cuDNN runs its NHWC kernels
without the ``nchwToNhwcKernel`` / ``nhwcToNchwKernel`` transposes it puts around every conv
of a ``[B, C, L]`` input: on the H100 (torch 2.11, cuDNN 9.19, bf16), a graph replay of the
Qwen3-TTS decoder at 128 streams x 8 frames spent 6.9 ms of 35.6 ms in those transposes
(``vocoder_all_kernels`` of benchmarks/results/gpu_share_dense.json), and its 29 undilated
convs took 7.42 ms channels-last against 10.97 ms
(benchmarks/results/vocoder_convs_channels_last.json). Dilated convs run by phases in both
layouts (:func:`conv1d_by_phases`): channels-last, cuDNN's own dilated kernels were far worse
still (the 384-channel conv at dilation 9, 128 streams: 689 ms; the 192-channel ones at
dilations 3 and 9, 8 streams: 43 ms; same file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.paged_attention import triton_runs

# SnakeBeta's division guard and ConvNeXt's LayerNorm epsilon: the reference decoders'
# constants (qwen_tts 12 Hz tokenizer, transformers' Qwen3-Omni code2wav).
SNAKE_EPS = 1e-9
CONVNEXT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class VocoderConfig:
    """The dimensions the layers read (Qwen3-TTS's speech tokenizer values as defaults).

    Attributes:
        latent_dim: width around the transformer and of the upsampler [1024].
        hidden_size / intermediate_size / num_hidden_layers: the transformer [512 / 1024 / 8].
        num_attention_heads / num_key_value_heads / head_dim: [16 / 16 / 64].
        rope_theta: RoPE base [10000]. rms_norm_eps: [1e-5].
        sliding_window: keys a query sees, itself included [72 frames].
        num_quantizers: code groups per frame [16].
        upsample_rates: the vocoder blocks' strides [8, 5, 4, 3].
        upsampling_ratios: the transposed convs before the vocoder [2, 2].
        decoder_dim: channels entering the vocoder blocks [1536], halved by each block.
    """

    latent_dim: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    sliding_window: int = 72
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    @property
    def samples_per_frame(self) -> int:
        """Output samples per code frame: the product of all upsampling strides [1920]."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, L]``, or channels-last ``[B, C, 1, L]`` -> ``[B, L, C]`` (a view; contiguous
    for a contiguous channels-last ``x``, whose memory it is)."""
    return (x.squeeze(2) if x.dim() == 4 else x).transpose(1, 2)


def from_rows(h: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``[B, L, C]`` -> ``[B, C, L]``, or with ``channels_last`` ``[B, C, 1, L]``, channels-last
    for a contiguous ``h`` (a view: ``h``'s memory is that layout)."""
    h = h.transpose(1, 2)
    return h.unsqueeze(2) if channels_last else h


def is_vocoder_layout(x: torch.Tensor) -> bool:
    """Whether ``x`` has the shape of an activation of either layout: ``[B, C, L]``, or
    ``[B, C, 1, L]`` (channels-last)."""
    return x.dim() == 3 or x.dim() == 4 and x.shape[2] == 1


def _per_channel(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``p [C]`` viewed to broadcast over the channels of ``x`` (``[B, C, L]`` or ``[B, C, 1,
    L]``)."""
    return p.view(-1, *(1,) * (x.dim() - 2))


def conv1d_in_layout(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, groups: int = 1
) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, groups=groups)`` (stride 1, no padding, undilated) of ``x
    [B, C, L]`` -> ``[B, C_out, L - k + 1]``; of channels-last ``x [B, C, 1, L]`` the 2-D
    conv of kernel ``(1, k)`` (``weight [C_out, C / groups, k]`` viewed as ``[C_out, C /
    groups, 1, k]``: channels-last, no copy, once :meth:`CarriedStateVocoder.to_channels_last`
    has laid it out) -> ``[B, C_out, 1, L - k + 1]`` channels-last. ``x``'s dtype."""
    if x.dim() == 4:
        return F.conv2d(x, weight.unsqueeze(2), bias, groups=groups)
    return F.conv1d(x, weight, bias, groups=groups)


class Carry:
    """A forward pass's per-stream state: ``old[i]`` is read and ``new[i]`` written by the
    layer whose ``state_index`` is ``i``. Tensors are batched: ``[B, *state_shape]``."""

    def __init__(self, old: list[torch.Tensor], positions: torch.Tensor) -> None:
        self.old = old
        self.new: list[torch.Tensor | None] = [None] * len(old)
        self.positions = positions  # [B] int64: frames already decoded by each stream


class _Stateful(nn.Module):
    """A layer with carried state; the decoder numbers these in module order."""

    state_index = -1

    def state_shape(self) -> tuple[int, ...]:
        """Per-stream state shape (without the batch dimension)."""
        raise NotImplementedError

    def carries_state(self) -> bool:
        """Whether the layer has a state to carry (and a state index)."""
        return True


class _InputHistory(_Stateful):
    """A conv whose state is the last ``history`` samples of its input: per stream ``[C,
    H]``, or ``[H, C]`` channels-last (:attr:`channels_last`), so that a batch's ``[B, H, C]``
    is contiguous and is the memory of the channels-last ``[B, C, 1, H]`` the layer reads."""

    channels_last = False
    history = 0
    conv: nn.Conv1d | nn.ConvTranspose1d

    def state_shape(self) -> tuple[int, ...]:
        channels = self.conv.in_channels
        return (self.history, channels) if self.channels_last else (channels, self.history)

    def carries_state(self) -> bool:
        return self.history > 0

    def _past(self, carry: Carry) -> torch.Tensor:
        """The carried input samples in the activations' layout (a view)."""
        past = carry.old[self.state_index]
        return from_rows(past, True) if self.channels_last else past

    def _keep(self, carry: Carry, tail: torch.Tensor) -> None:
        """Carry ``tail`` (the last ``history`` input samples, the activations' layout)."""
        carry.new[self.state_index] = to_rows(tail) if self.channels_last else tail


class CausalConv(_InputHistory):
    """``nn.Conv1d`` (stride 1) fed with ``(k - 1) * dilation`` past samples on the left:
    zeros at the start, the previous chunk's tail afterwards.

    A dilated conv runs as :func:`conv1d_by_phases` over its input right-padded to a
    multiple of the dilation.

    ``zero_before = (samples, rate)`` (None by default) zeroes the input samples whose index
    in the stream, ``frame * rate + i`` at ``rate`` samples per frame, is below ``samples``:
    they are not signal (see :attr:`CarriedStateVocoder.leading_trim`), so the conv sees
    there the zero padding it sees before the stream starts.

    ``x`` is ``[B, C, L]``, or ``[B, C, 1, L]`` channels-last with :attr:`channels_last` (see
    the module docstring); the output is ``[B, C_out, L]`` in the same layout.

    ``forward(x, carry, add_bias=False)`` leaves the conv's bias out, for a consumer that adds it
    in its own pass (:class:`ResidualUnit`); ``forward(x, carry, activation=snake)`` is the
    conv of ``snake(x)``, the activation writing the conv's input with its history (one pass
    over the samples instead of two; the Qwen3-TTS decoder's graph replay at 128 streams x 8
    frames on the H100: 38.7 -> 36.7 ms, benchmarks/results/vocoder_gpu_h100_phases2.json
    against ..._history.json)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.history = (kernel - 1) * dilation
        self.zero_before: tuple[int, int] | None = None

    def forward(
        self,
        x: torch.Tensor,
        carry: Carry,
        add_bias: bool = True,
        activation: SnakeBeta | None = None,
    ) -> torch.Tensor:
        conv = self.conv
        b = conv.bias if add_bias else None
        if self.history == 0:
            x = x if activation is None else activation(x)
            return conv1d_in_layout(x, conv.weight, b, conv.groups)
        past = self._past(carry)
        n = x.shape[-1]
        d = conv.dilation[0]
        length = past.shape[-1] + n
        pad = -length % d  # the phase form's right padding (none undilated)
        if activation is None:
            x = _with_history(past, x, pad)
        else:
            x = activation(x, past=past, zeros=pad)
        if self.zero_before is not None:  # on the new samples, in place, before the state
            samples, rate = self.zero_before
            index = carry.positions[:, None] * rate + torch.arange(n, device=x.device)
            keep = (index >= samples).to(x.dtype).view(x.shape[0], *(1,) * (x.dim() - 2), n)
            x[..., self.history : length].mul_(keep)
        self._keep(carry, x[..., length - self.history : length])
        if d == 1:
            return conv1d_in_layout(x, conv.weight, b, conv.groups)
        return conv1d_by_phases(x, conv.weight, b, d, conv.groups)[..., : length - self.history]


def _with_history(past: torch.Tensor | None, x: torch.Tensor, zeros: int) -> torch.Tensor:
    """``cat([past, x, zeros])`` along the last axis: ``past [B, C, H]`` (or none), ``x [B,
    C, L]``, ``zeros`` zero samples -> ``[B, C, H + L + zeros]``; or the same of channels-last
    ``[B, C, 1, *]`` parts -> channels-last. Those are joined as ``[B, *, C]`` rows (views),
    whose 3-D ``cat`` is contiguous: the channels-last memory. A 4-D ``cat`` infers NCL
    unless every part has channels-last strides, and a part of one sample (``[B, C, 1, 1]``,
    both layouts at once) may come from an elementwise op with NCL strides."""
    if x.dim() == 3:
        parts = [x] if past is None else [past, x]
        if zeros:
            parts.append(x.new_zeros(*x.shape[:-1], zeros))
        return torch.cat(parts, dim=-1)
    rows = [to_rows(x)] if past is None else [to_rows(past), to_rows(x)]
    if zeros:
        rows.append(x.new_zeros(x.shape[0], zeros, x.shape[1]))
    return from_rows(torch.cat(rows, dim=1), True)


def conv1d_by_phases(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int, groups: int = 1
) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, dilation=d, groups=groups)`` (no padding, stride 1) as the
    undilated conv over the ``d`` phases of ``x``: ``x [B, C, L]`` (``L`` a multiple of
    ``d``; copied first unless contiguous) viewed as ``[B, C, L / d, d]`` (sample ``q * d +
    p`` at ``(q, p)``) and convolved by a 2-D conv of kernel ``(k, 1)``: output ``t = q * d
    + p`` reads inputs ``t + d * j`` (``j < k``), at ``(q + j, p)``. The same sums; the
    input and output reshapes are views -> ``[B, C_out, L - (k - 1) * d]`` in ``x``'s
    dtype.

    Channels-last, ``x [B, C, 1, L]`` (memory ``[B, L, C]``, the same as ``[B, L / d, d,
    C]``) is viewed as the channels-last ``[B, C, L / d, d]``, no copy, and the output
    ``[B, C_out, L / d - k + 1, d]`` back as ``[B, C_out, 1, L - (k - 1) * d]``; the weight
    ``[C_out, C / groups, k]`` as ``[C_out, C / groups, k, 1]`` (channels-last once laid out
    by :meth:`CarriedStateVocoder.to_channels_last`).

    Why: cuDNN's heuristics pick a slow generic kernel (``implicit_convolve_sgemm``) for
    some dilated shapes of the Qwen3-TTS decoder and for none of its undilated ones. On the
    H100 (torch 2.11, cuDNN 9.19; benchmarks/results/vocoder_convs.json): 384 channels at
    dilation 9, 128 streams x 8 frames, 11.5 ms, against 1.0 ms at dilation 3 and 0.79 ms
    by phases; 192 channels at dilations 3 and 9, 8 streams, 1.1 ms against 0.19 ms by
    phases. Where cuDNN's own pick is good the phase form costs up to 0.3 ms more a conv
    (96 channels, 128 streams: 1.91 against 1.59 ms); over the decoder's eight dilated
    convs it takes 20.2 -> 9.7 ms at 128 streams, 2.9 -> 1.4 ms at 8, 0.52 -> 0.61 ms at 1.

    Raises:
        ValueError: ``dilation < 1``, or ``x`` is not ``[B, C, L]`` or ``[B, C, 1, L]`` with
            ``L`` a multiple of ``dilation`` and at least the kernel's span.
    """
    kernel = weight.shape[-1]
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    if not is_vocoder_layout(x) or x.shape[-1] % dilation or x.shape[-1] < (kernel - 1) * dilation + 1:
        raise ValueError(
            f"x must be [B, C, L] or [B, C, 1, L] with L a multiple of the dilation {dilation} "
            f"and at least {(kernel - 1) * dilation + 1}, got {tuple(x.shape)}"
        )
    if x.dim() == 4:
        phases = x.squeeze(2).unflatten(-1, (-1, dilation))
        return F.conv2d(phases, weight[..., None], bias, groups=groups).flatten(-2).unsqueeze(2)
    phases = x.contiguous().view(*x.shape[:-1], -1, dilation)
    return F.conv2d(phases, weight[..., None], bias, groups=groups).flatten(-2)


class CausalTransConv(_InputHistory):
    """``nn.ConvTranspose1d(kernel, stride)`` with the last ``kernel - stride`` outputs
    trimmed (the reference's causal transposed conv). With ``kernel = (h + 1) * stride``
    each output block depends on the current and the ``h`` previous input frames, so the
    state is those ``h`` input frames. ``[B, C, n]`` -> ``[B, C_out, n * stride]``, or
    channels-last ``[B, C, 1, n]`` -> ``[B, C_out, 1, n * stride]`` (a 2-D transposed conv of
    kernel ``(1, kernel)``, stride ``(1, stride)``) with :attr:`channels_last`.

    Raises:
        ValueError: ``kernel`` is not a multiple of ``stride``.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        if kernel % stride:
            raise ValueError(
                f"transposed conv kernel {kernel} is not a multiple of its stride {stride}"
            )
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.history = kernel // stride - 1

    def forward(
        self, x: torch.Tensor, carry: Carry, activation: SnakeBeta | None = None
    ) -> torch.Tensor:
        """The transposed conv of ``x`` (of ``activation(x)`` when given, as
        :class:`CausalConv`'s) after the carried input frames."""
        n = x.shape[-1]
        if self.history == 0:
            return self._transposed(x if activation is None else activation(x))
        past = self._past(carry)
        x = _with_history(past, x, 0) if activation is None else activation(x, past=past)
        self._keep(carry, x[..., -self.history :])
        start = self.history * self.stride
        return self._transposed(x)[..., start : start + n * self.stride]

    def _transposed(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if x.dim() == 4:
            weight = conv.weight.unsqueeze(2)
            return F.conv_transpose2d(x, weight, conv.bias, stride=(1, self.stride))
        return conv(x)


class SnakeBeta(nn.Module):
    """``x + sin(x * e^alpha)^2 / (e^beta + 1e-9)`` per channel (BigVGAN's SnakeBeta with
    log-scale parameters, as the checkpoint stores them). ``[B, C, L]`` -> same, or
    channels-last ``[B, C, 1, L]`` -> channels-last;
    ``forward(x, bias)`` with a ``[C]`` bias takes ``x + bias`` as its input (a preceding
    conv's bias, folded into this pass); ``forward(x, past=p, zeros=z)`` returns
    ``cat([p, snake(x), z zeros])`` (a causal conv's input: :class:`CausalConv` with an
    ``activation``).

    On CUDA with Triton installed, for fp32, bf16 and fp16 and without gradients (no
    autograd through it: the vocoders decode under inference mode, their weights frozen), it
    is one fused kernel computed in fp32
    (:func:`~omnistage.engine.triton_vocoder.snake_beta_triton`, why: there); else
    PyTorch's ops in ``x``'s dtype."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        past: torch.Tensor | None = None,
        zeros: int = 0,
    ) -> torch.Tensor:
        if triton_runs(x, self.alpha, self.beta, bias, past):
            from omnistage.engine.triton_vocoder import snake_beta_triton

            return snake_beta_triton(x, self.alpha, self.beta, SNAKE_EPS, bias, past, zeros)
        if bias is not None:
            x = x + _per_channel(bias, x)
        alpha = _per_channel(self.alpha.exp(), x)
        beta = _per_channel(self.beta.exp(), x)
        y = x + torch.sin(x * alpha).pow(2) / (beta + SNAKE_EPS)
        if past is None and not zeros:
            return y
        return _with_history(past, y, zeros)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class WindowAttention(_Stateful):
    """Causal self-attention over the last ``window`` frames (the query's own included),
    RoPE on absolute frame positions. State: the last ``window - 1`` frames' rotated keys
    and values, ``[2, kv_heads, window - 1, head_dim]``."""

    def __init__(self, config: VocoderConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def state_shape(self) -> tuple[int, ...]:
        return (2, self.kv_heads, self.window - 1, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        carry: Carry,
    ) -> torch.Tensor:
        """``x [B, n, hidden]``, ``rope`` = cos, sin ``[B, 1, n, head_dim]``, ``mask [B, 1, n,
        window - 1 + n]`` bool (True = attend)."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        past = carry.old[self.state_index]
        k = torch.cat([past[:, 0], k], dim=2)
        v = torch.cat([past[:, 1], v], dim=2)
        carry.new[self.state_index] = torch.stack([k, v], dim=1)[:, :, :, -(self.window - 1) :]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config: VocoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = WindowAttention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        carry: Carry,
    ) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(
            self.self_attn(self.input_layernorm(x), rope, mask, carry)
        )
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """``[B, n, latent]`` -> ``[B, n, latent]`` through the sliding-window transformer;
    ``projections=False`` (code2wav: latent = hidden) drops the linear maps around it."""

    def __init__(self, config: VocoderConfig, projections: bool = True) -> None:
        super().__init__()
        self.window = config.sliding_window
        identity = nn.Identity()
        self.input_proj = (
            nn.Linear(config.latent_dim, config.hidden_size) if projections else identity
        )
        self.layers = nn.ModuleList(
            TransformerLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = (
            nn.Linear(config.hidden_size, config.latent_dim) if projections else identity
        )
        # RoPE frequencies: a plain fp32 tensor, not a buffer, so casting the module to bf16
        # leaves them exact (a bf16 inv_freq shifts the phases of late frames); _apply keeps
        # them on the weights' device.
        self.inv_freq = _inv_freq(config)
        self._config = config

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 -- nn.Module's signature
        super()._apply(fn, recurse)
        self.inv_freq = _inv_freq(self._config).to(self.norm.weight.device)
        return self

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        n = x.shape[1]
        steps = torch.arange(n, device=x.device)
        query_pos = carry.positions[:, None] + steps  # [B, n]
        past = torch.arange(1 - self.window, 0, device=x.device)  # the carried keys' offsets
        key_pos = torch.cat(
            [carry.positions[:, None] + past, query_pos], dim=1
        )  # [B, window - 1 + n]
        delta = query_pos[:, :, None] - key_pos[:, None, :]
        mask = ((key_pos[:, None, :] >= 0) & (delta >= 0) & (delta < self.window))[:, None]
        freqs = query_pos[..., None].float() * self.inv_freq.float()  # RoPE in fp32
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        rope = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, rope, mask, carry)
        return self.output_proj(self.norm(h))


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7, LayerNorm, 4x pointwise MLP (GELU), scaled residual. ``[B,
    C, L]`` or channels-last ``[B, C, 1, L]`` -> the same; the norm and MLP work on ``[B, L,
    C]`` rows, which are channels-last memory as it is (a view, no transpose copy)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=CONVNEXT_NORM_EPS)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        h = to_rows(self.dwconv(x, carry))
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + from_rows(self.gamma * h, x.dim() == 4)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        """``x + conv2(act2(conv1(act1(x))))``, each conv's bias added by the pass after it
        (``act2``, the residual add) instead of by PyTorch, which adds a conv's bias after
        cuDNN's kernel in a broadcast pass of its own: at 128 streams x 8 frames on the H100
        the residual units' were 7.9 ms of the Qwen3-TTS decoder's 40.2 ms of convs (its
        96-channel 1x1 conv: 0.90 ms with the bias, 0.29 ms without;
        benchmarks/results/vocoder_convs.json). In fp32 the PyTorch path computes the same
        sums; in bf16 it rounds after each op where the kernels round once."""
        h = self.act2(self.conv1(x, carry, add_bias=False, activation=self.act1), self.conv1.conv.bias)
        y = self.conv2(h, carry, add_bias=False)
        bias = self.conv2.conv.bias
        if triton_runs(x, y, bias):
            from omnistage.engine.triton_vocoder import residual_add_triton

            return residual_add_triton(x, y, bias)
        return x + (y + _per_channel(bias, x))


class VocoderBlock(nn.Module):
    """SnakeBeta, transposed conv ``(2r, r)`` halving the channels, residual units 1/3/9.
    ``block`` is a list for the checkpoint's names (``block.0`` .. ``block.4``)."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [
                SnakeBeta(cin),
                CausalTransConv(cin, cout, 2 * rate, rate),
                *(ResidualUnit(cout, d) for d in (1, 3, 9)),
            ]
        )

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        x = self.block[1](x, carry, activation=self.block[0])
        for unit in self.block[2:]:
            x = unit(x, carry)
        return x


class CarriedStateVocoder(nn.Module):
    """Latents -> waveform through the upsampler and vocoder blocks, offline
    (:meth:`forward`) or one chunk at a time (:meth:`step`), with carried state.

    A subclass builds its latent path, calls :meth:`_build_vocoder` then
    :meth:`_number_states`, and implements :meth:`latents`. The state of one stream is a
    list of tensors of :meth:`state_shapes` (zeros = nothing decoded yet) plus its absolute
    frame position; :mod:`omnistage.engine.vocoder_arena` keeps them in an arena.

    Attributes:
        samples_per_frame: output samples per code frame (1920).
        num_quantizers: code groups per frame (16).
        leading_trim: samples that open every stream and are not audio (0 here; code2wav:
            555). :meth:`step` returns them at the start of the first chunk's row; offline
            decoding and the streaming arena drop them.
        channels_last: the activations' layout (False: ``[B, C, L]``; True: channels-last
            ``[B, C, 1, L]``, see the module docstring); set by :meth:`to_channels_last`.
    """

    leading_trim = 0
    channels_last = False

    def _build_vocoder(self, config: VocoderConfig) -> None:
        c = config
        self.samples_per_frame = c.samples_per_frame
        self.num_quantizers = c.num_quantizers
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [CausalTransConv(c.latent_dim, c.latent_dim, r, r), ConvNeXtBlock(c.latent_dim)]
            )
            for r in c.upsampling_ratios
        )
        dims = [c.decoder_dim // 2**i for i in range(len(c.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [
                CausalConv(c.latent_dim, c.decoder_dim, 7),
                *(VocoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(c.upsample_rates)),
                SnakeBeta(dims[-1]),
                CausalConv(dims[-1], 1, 7),
            ]
        )

    def _number_states(self) -> None:
        self._stateful = [
            m for m in self.modules() if isinstance(m, _Stateful) and m.carries_state()
        ]
        for index, module in enumerate(self._stateful):
            module.state_index = index

    def to_channels_last(self) -> CarriedStateVocoder:
        """Switch to channels-last activations (see the module docstring), in place; returns
        the vocoder. Lays every conv weight ``[A, B, k]`` out once in the memory order ``[A,
        k, B]`` (the same shapes and values in ``state_dict``, no longer contiguous: a writer that
        needs contiguous tensors, such as safetensors, takes ``.contiguous()`` copies): viewed as ``[A,
        B, 1, k]`` (or ``[A, B, k, 1]`` for a conv by phases), that is the channels-last
        weight cuDNN's NHWC kernels read, with no conversion per call (an extra kernel on
        every CUDA graph replay). The carried conv states become ``[H, C]`` per stream
        (:meth:`state_shapes`); the window attention's is unchanged. Later ``to()`` moves keep
        the layout; a ``load_state_dict(..., assign=True)`` replaces it (call this after
        loading), as does a state from before the switch (make arenas after it)."""
        _to_channels_last(self)
        self.channels_last = True
        return self

    def latents(self, codes: torch.Tensor, carry: Carry) -> torch.Tensor:
        """``codes [B, n, G]`` int64 -> latents ``[B, latent_dim, n]``, or channels-last
        ``[B, latent_dim, 1, n]`` with :attr:`channels_last`."""
        raise NotImplementedError

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Per-stream state tensor shapes, in state-index order (a conv's ``[C, H]``, or
        ``[H, C]`` with :attr:`channels_last`)."""
        return [m.state_shape() for m in self._stateful]

    def zero_state(
        self, batch: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """A fresh state for ``batch`` streams (model dtype and device by default)."""
        weight = self.decoder[0].conv.weight
        return [
            torch.zeros(batch, *s, device=device or weight.device, dtype=dtype or weight.dtype)
            for s in self.state_shapes()
        ]

    def step(
        self, codes: torch.Tensor, positions: torch.Tensor, state: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Decode the next ``n`` frames of ``B`` streams.

        Args:
            codes: ``[B, n, G]`` int64 code frames (``G`` = ``num_quantizers``, 16).
            positions: ``[B]`` int64, frames each stream decoded before.
            state: the streams' carried state (``[B, *shape]`` per :meth:`state_shapes`).

        Returns:
            ``(audio, new_state)``: ``audio [B, n * samples_per_frame]`` in [-1, 1] in the
            model dtype (a stream's first :attr:`leading_trim` samples are no audio); the
            state after these frames (the caller advances positions by n).

        Raises:
            ValueError: ``codes`` is not ``[B, n, num_quantizers]`` with ``n >= 1``, or
                ``state`` is not ``[B, *shape]`` per :meth:`state_shapes` (e.g. a state made
                before :meth:`to_channels_last`, whose conv histories are ``[C, H]``).
        """
        if codes.dim() != 3 or codes.shape[1] < 1 or codes.shape[2] != self.num_quantizers:
            raise ValueError(
                f"codes must be [B, n>=1, {self.num_quantizers}], got {tuple(codes.shape)}"
            )
        shapes = self.state_shapes()
        if len(state) != len(shapes) or any(
            t.shape != (codes.shape[0], *s) for t, s in zip(state, shapes, strict=False)
        ):
            raise ValueError(
                f"state must be [B={codes.shape[0]}, *shape] per state_shapes() {shapes} "
                f"(channels_last={self.channels_last}), got {[tuple(t.shape) for t in state]}"
            )
        carry = Carry(state, positions)
        h = self.latents(codes, carry)
        for transconv, convnext in self.upsample:
            h = convnext(transconv(h, carry), carry)
        *body, activation, output_conv = self.decoder  # _build_vocoder's order
        for layer in body:
            h = layer(h, carry)
        h = output_conv(h, carry, activation=activation)  # [B, 1, L] or [B, 1, 1, L]
        new_state = [t for t in carry.new if t is not None]
        assert len(new_state) == len(state), "every stateful layer writes its state"
        return h.flatten(1).clamp(-1.0, 1.0), new_state

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Offline decode: ``codes [B, T, G]`` int64 -> ``[B, T * samples_per_frame -
        leading_trim]`` (model dtype, in [-1, 1]). Raises ValueError as :meth:`step`."""
        positions = torch.zeros(codes.shape[0], dtype=torch.int64, device=codes.device)
        return self.step(codes, positions, self.zero_state(codes.shape[0]))[0][
            :, self.leading_trim :
        ]


def _to_channels_last(layers: nn.Module) -> None:
    """:meth:`CarriedStateVocoder.to_channels_last` of any layers: each conv weight laid out
    channels-last, each carried conv state switched to ``[H, C]``."""
    for module in layers.modules():
        if isinstance(module, nn.Conv1d | nn.ConvTranspose1d):
            module.weight.data = module.weight.data.transpose(1, 2).contiguous().transpose(1, 2)
        if isinstance(module, _InputHistory):
            module.channels_last = True


def _inv_freq(config: VocoderConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` fp32: ``theta^(-2i / head_dim)``."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return 1.0 / (config.rope_theta**exponents)
