"""Qwen3-Omni's code2wav: talker code frames ``[B, T, 16]`` -> 24 kHz PCM, offline or streamed.

Architecture (shared/reference/qwen3-omni.md, section 1; numerics follow transformers 5.24
``Qwen3OmniMoeCode2Wav``; weight names are the checkpoint's under ``code2wav.``): one
embedding table shared by the 16 quantizers (quantizer ``q`` reads rows ``q * 2048 +
code``), the 16 embeddings of a frame AVERAGED, the sliding-window transformer (72 frames,
RoPE, LayerScale) without projections, then the upsampler and vocoder blocks of Qwen3-TTS's
speech tokenizer decoder (the same layers and names, reused from there). 1920 samples per
frame at 24 kHz.

The one difference in the vocoder: the reference's transposed convs trim ``kernel -
stride`` samples on BOTH sides (Qwen3-TTS's trim only the right), so each of the four
vocoder blocks drops its first output block and offline decoding of ``n`` frames gives
``n * 1920 - 555`` samples (555 = ((((0 + 1) * 8 + 1) * 5 + 1) * 4 + 1) * 3). We compute
the causal stream of Qwen3-TTS's layers, in which those dropped samples lead every layer's
output, and zero them (``CausalConv.zero_before``) wherever a causal conv would read them:
the reference's layers see zero padding there. The stream's first 555 output samples are
then no audio (:attr:`Code2Wav.leading_trim`) and the rest equals the reference exactly,
for any chunk schedule, with the carried state of :class:`CarriedStateVocoder` (so the
streaming arena and the shared streaming vocoder serve code2wav as they serve Qwen3-TTS).
``to_channels_last()`` switches its activations to channels-last, the zeroed samples
included (:mod:`omnistage.engine.causal_vocoder`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistage.engine.causal_vocoder import (
    CarriedStateVocoder,
    Carry,
    PreTransformer,
    VocoderBlock,
    VocoderConfig,
    from_rows,
)


@dataclass(frozen=True, slots=True)
class Code2WavConfig(VocoderConfig):
    """code2wav's dimensions: the vocoder layers' fields (real checkpoint values as
    defaults) with ``latent_dim = hidden_size`` [1024]: 16 quantizers x ``codebook_size``
    [2048] codes in one embedding table, 8 layers, 16 / 16 heads of 64, SwiGLU 3072,
    window 72, RoPE base 10000, RMSNorm eps 1e-5, upsampling ratios [2, 2], vocoder rates
    [8, 5, 4, 3] from 1536 channels."""

    codebook_size: int = 2048
    latent_dim: int = 1024
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> Code2WavConfig:
        """Parse ``code2wav_config`` (RoPE base from ``rope_parameters``, ``rope_scaling`` or
        ``rope_theta``; ``head_dim`` = hidden / heads when absent, as the reference);
        unknown keys are ignored, missing ones take the real checkpoint's values.

        Raises:
            ValueError: naming the field: ``hidden_act`` other than silu, attention bias,
                or a RoPE type other than the default.
        """
        names = set(cls.__dataclass_fields__) - {"latent_dim", "head_dim", "rope_theta"}
        values: dict[str, Any] = {k: v for k, v in raw.items() if k in names}
        for key in ("upsample_rates", "upsampling_ratios"):
            if key in values:
                values[key] = tuple(int(v) for v in values[key])
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"code2wav_config.rope_parameters.rope_type: only 'default', got {rope['rope_type']!r}"
            )
        if "rope_theta" in rope or "rope_theta" in raw:
            values["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta")))
        defaults = cls.__dataclass_fields__
        hidden = values.get("hidden_size", defaults["hidden_size"].default)
        heads = values.get("num_attention_heads", defaults["num_attention_heads"].default)
        values["head_dim"] = int(raw.get("head_dim") or hidden // heads)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"code2wav_config.hidden_act: only 'silu' is supported, got {raw['hidden_act']!r}"
            )
        if raw.get("attention_bias", False):
            raise ValueError("code2wav_config.attention_bias: attention biases are not supported")
        return cls(**values, latent_dim=hidden)


def leading_trim(config: VocoderConfig) -> int:
    """Samples the reference's vocoder blocks drop at the start: each block of rate ``r``
    turns ``d`` dropped input samples into ``(d + 1) * r`` [555]."""
    dropped = 0
    for rate in config.upsample_rates:
        dropped = (dropped + 1) * rate
    return dropped


class Code2Wav(CarriedStateVocoder):
    """Code frames -> waveform (see the module docstring). Offline :meth:`forward` gives
    ``[B, T * 1920 - 555]``; :meth:`step` is the carried-state chunk decode."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        c = self.config = config
        self.pre_transformer = PreTransformer(c, projections=False)
        self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        self._build_vocoder(c)
        self._zero_dropped_samples()
        self._number_states()
        self.leading_trim = leading_trim(c)

    def _zero_dropped_samples(self) -> None:
        """Mark each causal conv after a vocoder block's transposed conv with the samples
        the reference drops before it (see the module docstring)."""
        dropped, rate = 0, math.prod(self.config.upsampling_ratios)
        for layer in self.decoder:
            if isinstance(layer, VocoderBlock):
                stride = layer.block[1].stride
                dropped, rate = (dropped + 1) * stride, rate * stride
                for unit in layer.block[2:]:
                    unit.conv1.zero_before = (dropped, rate)
        self.decoder[-1].zero_before = (dropped, rate)

    def reset_buffers(self, device: torch.device | str) -> None:
        """After a load onto ``device`` from the meta device: recompute the pre-transformer's
        RoPE frequencies there (a plain tensor, recomputed by ``nn.Module._apply``)."""
        self.to(device)

    def latents(self, codes: torch.Tensor, carry: Carry) -> torch.Tensor:
        """``codes [B, n, 16]`` int64 in ``[0, codebook_size)`` -> ``[B, hidden, n]``, or
        ``[B, hidden, 1, n]`` channels-last (the transformer's ``[B, n, hidden]`` viewed) with
        :attr:`channels_last`."""
        offsets = (
            torch.arange(self.config.num_quantizers, device=codes.device)
            * self.config.codebook_size
        )
        embedded = self.code_embedding(codes + offsets).mean(dim=2)  # [B, n, hidden]
        return from_rows(self.pre_transformer(embedded, carry), self.channels_last)


def expected_weights(config: Code2WavConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (without the ``code2wav.`` prefix) and shapes."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in Code2Wav(config).state_dict().items()}
