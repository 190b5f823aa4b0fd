"""The Qwen3-TTS 12 Hz speech tokenizer's decoder: codes ``[B, T, 16]`` -> 24 kHz PCM.

Architecture (shared/reference/qwen3-tts.md, section 6; weight names are the checkpoint's,
prefix ``decoder.``): split residual quantizer (code group 0 through ``rvq_first``, groups
1..15 through ``rvq_rest``, each summed then projected 256 -> 512) -> causal conv k3
512 -> 1024 -> transformer (1024 -> 512, 8 layers with a 72-frame sliding window, RoPE,
LayerScale, -> 1024) -> 2 x [transposed conv k2 s2 + ConvNeXt] -> causal conv k7
1024 -> 1536 -> 4 blocks (SnakeBeta, transposed conv k=2r s=r, 3 residual units with
dilations 1/3/9) for r = 8, 5, 4, 3 -> SnakeBeta -> conv k7 -> 1 channel -> clamp [-1, 1].
1920 samples per frame.

Every layer is causal, so one implementation serves offline and streaming decoding: each
layer that looks back (17 causal convs with k > 1, the transformer's KV window, the 4
transposed convs whose kernel outlasts their stride) reads its carried state from a flat list and writes
the updated state to another (:class:`Carry`). Offline decoding is streaming from a zero
state: the zero history is exactly the causal convs' left zero padding, and the masked-out
KV window is what the sliding-window mask removes. So a prefix decodes to a prefix of the
full decode, and chunked decoding with carried state concatenates to the offline decode.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import (
    DecoderConfig,
    SpeechTokenizerConfig,
)

# The codebook's usage floor and SnakeBeta's division guard: the reference decoder's
# constants (qwen_tts 12 Hz tokenizer, EuclideanCodebook / SnakeBeta).
CLUSTER_USAGE_FLOOR = 1e-5
SNAKE_EPS = 1e-9
# ConvNeXt's LayerNorm epsilon in the reference decoder.
CONVNEXT_NORM_EPS = 1e-6


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


class CausalConv(_Stateful):
    """``nn.Conv1d`` (stride 1) fed with ``(k - 1) * dilation`` past samples on the left:
    zeros at the start, the previous chunk's tail afterwards."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.history = (kernel - 1) * dilation

    def state_shape(self) -> tuple[int, ...]:
        return (self.conv.in_channels, self.history)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        if self.history == 0:
            return self.conv(x)
        x = torch.cat([carry.old[self.state_index], x], dim=-1)
        carry.new[self.state_index] = x[..., -self.history :]
        return self.conv(x)


class CausalTransConv(_Stateful):
    """``nn.ConvTranspose1d(kernel, stride)`` with the last ``kernel - stride`` outputs
    trimmed (the reference's causal transposed conv). With ``kernel = (h + 1) * stride``
    each output block depends on the current and the ``h`` previous input frames, so the
    state is those ``h`` input frames.

    Raises:
        ValueError: ``kernel`` is not a multiple of ``stride``.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        if kernel % stride:
            raise ValueError(f"transposed conv kernel {kernel} is not a multiple of its stride {stride}")
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.history = kernel // stride - 1

    def state_shape(self) -> tuple[int, ...]:
        return (self.conv.in_channels, self.history)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        n = x.shape[-1]
        if self.history == 0:
            return self.conv(x)
        x = torch.cat([carry.old[self.state_index], x], dim=-1)
        carry.new[self.state_index] = x[..., -self.history :]
        start = self.history * self.stride
        return self.conv(x)[..., start : start + n * self.stride]


class SnakeBeta(nn.Module):
    """``x + sin(x * e^alpha)^2 / (e^beta + 1e-9)`` per channel (BigVGAN's SnakeBeta with
    log-scale parameters, as the checkpoint stores them). ``[B, C, L]`` -> same."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + torch.sin(x * alpha).pow(2) / (beta + SNAKE_EPS)


class Codebook(nn.Module):
    """An EMA codebook as stored: vectors = ``embedding_sum / max(cluster_usage, 1e-5)``."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def vectors(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=CLUSTER_USAGE_FLOOR)[:, None]


class _CodebookHolder(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(size, dim)


class _VQStack(nn.Module):
    def __init__(self, count: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CodebookHolder(size, dim) for _ in range(count))


class ResidualQuantizer(nn.Module):
    """Codebooks summed, then a bias-free 1x1 projection ``dim -> out_dim``."""

    def __init__(self, count: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.vq = _VQStack(count, size, dim)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, n, count]`` int64 -> ``[B, out_dim, n]``."""
        summed = sum(layer._codebook.vectors()[codes[..., i]] for i, layer in enumerate(self.vq.layers))
        return self.output_proj(summed.transpose(1, 2))


class SplitQuantizer(nn.Module):
    """Code group 0 (semantic) and groups 1.. (acoustic) through separate quantizers."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        dim, size = config.codebook_dim // 2, config.codebook_size
        self.rvq_first = ResidualQuantizer(1, size, dim, config.codebook_dim)
        self.rvq_rest = ResidualQuantizer(config.num_quantizers - 1, size, dim, config.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, n, G]`` -> ``[B, codebook_dim, n]``."""
        return self.rvq_first(codes[..., :1]) + self.rvq_rest(codes[..., 1:])


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

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def state_shape(self) -> tuple[int, ...]:
        return (2, self.kv_heads, self.window - 1, self.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, carry: Carry) -> torch.Tensor:
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
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
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
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = WindowAttention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, carry: Carry) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, mask, carry))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """``[B, n, latent]`` -> ``[B, n, latent]`` through the sliding-window transformer."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.window = config.sliding_window
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)
        # RoPE frequencies: a plain fp32 tensor, not a buffer, so casting the module to bf16
        # leaves them exact (a bf16 inv_freq shifts the phases of late frames); _apply keeps
        # them on the weights' device.
        self.inv_freq = _inv_freq(config)
        self._config = config

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 -- nn.Module's signature
        super()._apply(fn, recurse)
        self.inv_freq = _inv_freq(self._config).to(self.input_proj.weight.device)
        return self

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        n = x.shape[1]
        steps = torch.arange(n, device=x.device)
        query_pos = carry.positions[:, None] + steps  # [B, n]
        past = torch.arange(1 - self.window, 0, device=x.device)  # the carried keys' offsets
        key_pos = torch.cat([carry.positions[:, None] + past, query_pos], dim=1)  # [B, window - 1 + n]
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
    """Causal depthwise conv k7, LayerNorm, 4x pointwise MLP (GELU), scaled residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=CONVNEXT_NORM_EPS)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        h = self.dwconv(x, carry).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), carry)), carry)


class VocoderBlock(nn.Module):
    """SnakeBeta, transposed conv ``(2r, r)`` halving the channels, residual units 1/3/9.
    ``block`` is a list for the checkpoint's names (``block.0`` .. ``block.4``)."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalTransConv(cin, cout, 2 * rate, rate), *(ResidualUnit(cout, d) for d in (1, 3, 9))]
        )

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        x = self.block[1](self.block[0](x), carry)
        for unit in self.block[2:]:
            x = unit(x, carry)
        return x


class SpeechTokenizerDecoder(nn.Module):
    """Codes -> waveform, offline (:meth:`forward`) or one chunk at a time (:meth:`step`).

    The state of one stream is a list of tensors of :meth:`state_shapes` (zeros = nothing
    decoded yet) plus its absolute frame position; :mod:`.streaming` keeps them in an arena.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.samples_per_frame = c.samples_per_frame
        self.quantizer = SplitQuantizer(c)
        self.pre_conv = CausalConv(c.codebook_dim, c.latent_dim, 3)
        self.pre_transformer = PreTransformer(c)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(c.latent_dim, c.latent_dim, r, r), ConvNeXtBlock(c.latent_dim)])
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
        self._stateful = [m for m in self.modules() if isinstance(m, _Stateful) and m.state_shape()[-1] > 0]
        for index, module in enumerate(self._stateful):
            module.state_index = index

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Per-stream state tensor shapes, in state-index order."""
        return [m.state_shape() for m in self._stateful]

    def zero_state(self, batch: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """A fresh state for ``batch`` streams (model dtype and device by default)."""
        weight = self.pre_conv.conv.weight
        return [torch.zeros(batch, *s, device=device or weight.device, dtype=dtype or weight.dtype) for s in self.state_shapes()]

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
            model dtype; the state after these frames (the caller advances positions by n).

        Raises:
            ValueError: ``codes`` is not ``[B, n, num_quantizers]`` with ``n >= 1``.
        """
        if codes.dim() != 3 or codes.shape[1] < 1 or codes.shape[2] != self.config.num_quantizers:
            raise ValueError(f"codes must be [B, n>=1, {self.config.num_quantizers}], got {tuple(codes.shape)}")
        carry = Carry(state, positions)
        h = self.pre_conv(self.quantizer(codes), carry)
        h = self.pre_transformer(h.transpose(1, 2), carry).transpose(1, 2)
        for transconv, convnext in self.upsample:
            h = convnext(transconv(h, carry), carry)
        for layer in self.decoder:
            h = layer(h, carry) if isinstance(layer, CausalConv | VocoderBlock) else layer(h)
        new_state = [t for t in carry.new if t is not None]
        assert len(new_state) == len(state), "every stateful layer writes its state"
        return h[:, 0].clamp(-1.0, 1.0), new_state

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Offline decode: ``codes [B, T, G]`` int64 -> ``[B, T * samples_per_frame]``
        (model dtype, in [-1, 1]). Raises ValueError as :meth:`step`."""
        positions = torch.zeros(codes.shape[0], dtype=torch.int64, device=codes.device)
        return self.step(codes, positions, self.zero_state(codes.shape[0]))[0]


def decoder_state_dict(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's tensors from a speech tokenizer checkpoint (prefix ``decoder.``
    stripped; the quantizers' ``input_proj``, used only for encoding, dropped)."""
    prefix = "decoder."
    return {
        k[len(prefix) :]: v
        for k, v in checkpoint.items()
        if k.startswith(prefix) and not (k.startswith("decoder.quantizer.") and k.endswith(".input_proj.weight"))
    }


def build_decoder(
    config: DecoderConfig,
    checkpoint: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> SpeechTokenizerDecoder:
    """The decoder with the weights of ``checkpoint`` (a whole speech tokenizer's tensors,
    checkpoint names), in eval mode on ``device`` in ``dtype``.

    Raises:
        RuntimeError: the decoder tensors do not match ``config`` (missing, unexpected or
            misshaped names).
    """
    with torch.device("meta"):
        decoder = SpeechTokenizerDecoder(config)
    decoder.load_state_dict(decoder_state_dict(checkpoint), strict=True, assign=True)
    return decoder.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_decoder(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> SpeechTokenizerDecoder:
    """Build the decoder from a ``speech_tokenizer`` folder (config.json, model.safetensors).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: the config is not a 12 Hz tokenizer's (see ``SpeechTokenizerConfig``).
        RuntimeError: as :func:`build_decoder`.
    """
    config = SpeechTokenizerConfig.load(directory)
    return build_decoder(config.decoder, load_file(Path(directory) / "model.safetensors"), device, dtype)


def _inv_freq(config: DecoderConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` fp32: ``theta^(-2i / head_dim)``."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return 1.0 / (config.rope_theta**exponents)
