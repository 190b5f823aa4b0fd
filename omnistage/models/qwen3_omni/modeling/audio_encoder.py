"""Qwen3-Omni's audio encoder (the thinker's ``audio_tower``): log-mel frames -> embeddings.

Architecture (shared/reference/qwen3-omni.md, section 1; numerics follow transformers 5.24
``Qwen3OmniMoeAudioEncoder``; weight names are the checkpoint's under
``thinker.audio_tower.``): each audio's 128-bin mel frames are cut into chunks of
``2 * n_window`` (100) frames; each chunk goes through three 3x3 stride-2 ``Conv2d`` + GELU
(over mel and time), a bias-free linear ``channels * mel/8 -> d_model`` and sinusoidal
positions that restart at 0 in every chunk (13 tokens per full chunk). The tokens of all
chunks then pass ``encoder_layers`` pre-LayerNorm transformer layers whose attention is
bidirectional within windows of ``n_window_infer`` frames (800 frames = 8 chunks = 104
tokens) of one audio, then LayerNorm, Linear, GELU, Linear -> ``output_dim``.

As in the reference, the chunks of one call are zero-padded to the longest among them, and
the second and third convolutions see the first ones' activations of those padding frames:
a short tail chunk's last tokens depend on what it is encoded with. Encode the audios of
one prompt in one call (as transformers does) to get the reference's embeddings; several
prompts go in one call with ``prompts`` (audios per prompt), which pads each prompt's
chunks to that prompt's own longest chunk, so each gets the rows it gets alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.model_runner import upload
from omnistage.models.qwen3_omni.modeling.segment_attention import Segments, attend_segments

# The sinusoids' longest period (Whisper's position embedding, as the reference).
MAX_TIMESCALE = 10000.0


@dataclass(frozen=True, slots=True)
class AudioEncoderConfig:
    """The audio encoder's dimensions (real checkpoint values as defaults).

    Attributes:
        num_mel_bins: mel bins per frame [128].
        encoder_layers / encoder_attention_heads / encoder_ffn_dim / d_model: [32 / 20 / 5120 / 1280].
        output_dim: embedding width handed to the thinker [2048] (= thinker hidden size).
        n_window: half a chunk, in mel frames [50]: chunks of 100 frames (1 s at 10 ms hops).
        n_window_infer: attention window in mel frames [800]; a multiple of ``2 * n_window``.
        downsample_hidden_size: channels of the three convolutions [480].
        max_source_positions: sinusoid table length [1500] (bounds tokens per chunk).
        conv_chunksize: chunks per convolution call, to bound its memory [500].
    """

    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    output_dim: int = 2048
    n_window: int = 50
    n_window_infer: int = 800
    downsample_hidden_size: int = 480
    max_source_positions: int = 1500
    conv_chunksize: int = 500
    activation_function: str = "gelu"

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> AudioEncoderConfig:
        """Parse ``thinker_config.audio_config``; unknown keys are ignored, missing ones
        take the real checkpoint's values.

        Raises:
            ValueError: an activation other than ``gelu``, heads that do not divide
                ``d_model``, or an attention window that is not a whole number of chunks.
        """
        names = set(cls.__dataclass_fields__)
        config = cls(**{k: v for k, v in raw.items() if k in names})
        if config.activation_function != "gelu":
            raise ValueError(
                f"audio_config.activation_function: only 'gelu' is supported, got {config.activation_function!r}"
            )
        if config.d_model % config.encoder_attention_heads:
            raise ValueError(
                f"audio_config: d_model {config.d_model} is not divisible by {config.encoder_attention_heads} heads"
            )
        if config.n_window_infer % (2 * config.n_window):
            raise ValueError(
                f"audio_config: n_window_infer {config.n_window_infer} is not a multiple of 2 * n_window"
            )
        return config

    @property
    def chunk_frames(self) -> int:
        """Mel frames per chunk (``2 * n_window``)."""
        return 2 * self.n_window

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens of a full chunk after the three stride-2 convolutions [13]."""
        return _conv_length(self.chunk_frames)

    @property
    def window_tokens(self) -> int:
        """Tokens per attention window [104]."""
        return self.tokens_per_chunk * (self.n_window_infer // self.chunk_frames)


def _conv_length(frames: int | torch.Tensor) -> int | torch.Tensor:
    """Length after three ``k3 s2 p1`` convolutions: ``ceil`` halving three times."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def output_lengths(frames: torch.Tensor, config: AudioEncoderConfig) -> torch.Tensor:
    """Embeddings per audio for ``frames`` mel frames (``[B]`` int64 -> ``[B]`` int64): full
    chunks give ``tokens_per_chunk`` (13) each, the tail chunk its convolution length
    (transformers' ``_get_feat_extract_output_lengths``; 0 frames -> 0)."""
    return (frames // config.chunk_frames) * config.tokens_per_chunk + _conv_length(
        frames % config.chunk_frames
    )


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    """``[length, channels]`` fp32: ``sin`` then ``cos`` of ``t * 10000^(-i / (C/2 - 1))``."""
    half = channels // 2
    increment = math.log(MAX_TIMESCALE) / (half - 1)
    inv_timescales = torch.exp(-increment * torch.arange(half).float())
    scaled = torch.arange(length).float()[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        d = config.d_model
        self.heads = config.encoder_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, windows: Segments) -> torch.Tensor:
        """``x [N, d_model]``, ``windows``: the attention windows, partitioning ``N``."""
        shape = (x.shape[0], self.heads, -1)
        q, k, v = (proj(x).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attend_segments(q, k, v, windows).reshape(x.shape[0], -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.self_attn = AudioAttention(config)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor, windows: Segments) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


@dataclass(frozen=True, slots=True)
class AudioEncoderOutput:
    """Attributes:
    embeddings: ``[sum(lengths), output_dim]`` in the model dtype, the audios end to end.
    lengths: ``[B]`` int64, embeddings per audio (:func:`output_lengths`).
    """

    embeddings: torch.Tensor
    lengths: torch.Tensor


class AudioEncoder(nn.Module):
    """Mel features of ``B`` audios -> their embeddings (see the module docstring)."""

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        self.config = c = config
        ch = c.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(ch * _conv_length(c.num_mel_bins), c.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(c) for _ in range(c.encoder_layers))
        self.ln_post = nn.LayerNorm(c.d_model)
        self.proj1 = nn.Linear(c.d_model, c.d_model)
        self.proj2 = nn.Linear(c.d_model, c.output_dim)

    def forward(
        self, features: torch.Tensor, frames: torch.Tensor, prompts: list[int] | None = None
    ) -> AudioEncoderOutput:
        """Encode ``B`` audios.

        Args:
            features: ``[num_mel_bins, sum(frames)]`` float log-mel frames, the audios end
                to end (the Whisper feature extractor's output with padding removed).
            frames: ``[B]`` int64 mel frames per audio, each >= 1.
            prompts: audios per prompt, in order, summing to ``B`` (None: one prompt). Each
                prompt's chunks are padded to its own longest chunk (the reference's padding
                of a call with that prompt alone); attention never crosses an audio, so a
                prompt's embeddings do not depend on the others of the call.

        Returns:
            :class:`AudioEncoderOutput`.

        Raises:
            ValueError: ``features`` is not ``[num_mel_bins, sum(frames)]``, an audio
                has no frames, or ``prompts`` does not partition the ``B`` audios.
        """
        c = self.config
        counts = [int(n) for n in frames.tolist()]
        if (
            features.dim() != 2
            or features.shape[0] != c.num_mel_bins
            or features.shape[1] != sum(counts)
        ):
            raise ValueError(
                f"features must be [{c.num_mel_bins}, {sum(counts)}], got {tuple(features.shape)}"
            )
        if not counts or min(counts) < 1:
            raise ValueError(f"every audio needs >= 1 mel frame, got {counts}")
        prompts = [len(counts)] if prompts is None else prompts
        if sum(prompts) != len(counts) or min(prompts) < 1:
            raise ValueError(f"prompts {prompts} do not partition {len(counts)} audios")
        per_audio = [
            [min(c.chunk_frames, n - s) for s in range(0, n, c.chunk_frames)] for n in counts
        ]
        chunk_lengths, chunk_pads, audios = [], [], iter(per_audio)
        for size in prompts:
            lengths = [n for _ in range(size) for n in next(audios)]
            chunk_lengths += lengths
            chunk_pads += [max(lengths)] * len(lengths)
        chunks = torch.split(features.T, chunk_lengths)  # [len, mel] each
        tokens = _conv_length(torch.tensor(chunk_lengths))  # [C] tokens per chunk
        starts = torch.cumsum(tokens, 0) - tokens
        # host-to-device copies by upload: one that waits would wait for all the work queued
        # on the stream the engines share
        device = self.conv_out.weight.device
        positions = upload(_sinusoids(_conv_length(max(chunk_pads)), c.d_model), device)
        x = None
        # the chunks padded to one length are convolved together, their tokens put in order
        for pad in sorted(set(chunk_pads)):
            picked = [i for i, p in enumerate(chunk_pads) if p == pad]
            # [Cp, pad, mel] -> [Cp, 1, mel, pad]
            padded = nn.utils.rnn.pad_sequence([chunks[i] for i in picked], batch_first=True)
            padded = padded.transpose(1, 2)[:, None].to(self.conv_out.weight.dtype)
            hidden = torch.cat(
                [self._convolve(part) for part in padded.split(c.conv_chunksize)]
            )  # [Cp, t, d]
            hidden = hidden + positions[: hidden.shape[1]].to(hidden)
            valid = (torch.arange(hidden.shape[1]) < tokens[picked][:, None]).reshape(-1).nonzero().flatten()
            rows = hidden.reshape(-1, c.d_model).index_select(0, upload(valid, device))  # [Np, d]: the picked chunks' tokens
            if len(picked) == len(chunk_pads):
                x = rows
                break
            if x is None:
                x = rows.new_empty(int(tokens.sum()), c.d_model)
            index = torch.cat([torch.arange(starts[i], starts[i] + tokens[i]) for i in picked])
            x.index_copy_(0, upload(index, device), rows)
        assert x is not None
        lengths = output_lengths(frames.cpu(), c)
        windows = Segments.of(
            [
                min(c.window_tokens, n - s)
                for n in lengths.tolist()
                for s in range(0, n, c.window_tokens)
            ],
            x.device,
        )
        for layer in self.layers:
            x = layer(x, windows)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        return AudioEncoderOutput(x, lengths)

    def _convolve(self, chunks: torch.Tensor) -> torch.Tensor:
        """``[C, 1, mel, len]`` -> ``[C, tokens, d_model]``."""
        h = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(chunks))))))
        b, ch, f, t = h.shape
        return self.conv_out(h.permute(0, 3, 1, 2).reshape(b, t, ch * f))


def expected_weights(config: AudioEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (without the ``thinker.audio_tower.`` prefix) and shapes."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in AudioEncoder(config).state_dict().items()}
