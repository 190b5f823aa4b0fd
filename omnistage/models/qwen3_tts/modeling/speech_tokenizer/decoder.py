"""The Qwen3-TTS 12 Hz speech tokenizer's decoder: codes ``[B, T, 16]`` -> 24 kHz PCM.

Architecture (shared/reference/qwen3-tts.md, section 6; weight names are the checkpoint's,
prefix ``decoder.``): split residual quantizer (code group 0 through ``rvq_first``, groups
1..15 through ``rvq_rest``, each summed then projected 256 -> 512) -> causal conv k3
512 -> 1024 -> transformer (1024 -> 512, 8 layers with a 72-frame sliding window, RoPE,
LayerScale, -> 1024) -> 2 x [transposed conv k2 s2 + ConvNeXt] -> causal conv k7
1024 -> 1536 -> 4 blocks (SnakeBeta, transposed conv k=2r s=r, 3 residual units with
dilations 1/3/9) for r = 8, 5, 4, 3 -> SnakeBeta -> conv k7 -> 1 channel -> clamp [-1, 1].
1920 samples per frame.

The transformer, upsampler and vocoder are the carried-state layers of
:mod:`omnistage.engine.causal_vocoder` (shared with Qwen3-Omni's code2wav): chunked
decoding with carried state concatenates to the offline decode. ``to_channels_last()``
switches its activations to channels-last, from the quantizer on (the layout and why:
:mod:`omnistage.engine.causal_vocoder`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from omnistage.engine.causal_vocoder import (
    CarriedStateVocoder,
    Carry,
    CausalConv,
    PreTransformer,
    conv1d_in_layout,
    from_rows,
    to_rows,
)
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import (
    DecoderConfig,
    SpeechTokenizerConfig,
)

# The codebook's usage floor: the reference decoder's constant (qwen_tts 12 Hz tokenizer,
# EuclideanCodebook).
CLUSTER_USAGE_FLOOR = 1e-5


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

    def forward(self, codes: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
        """``codes [B, n, count]`` int64 -> ``[B, out_dim, n]``, or with ``channels_last``
        ``[B, out_dim, 1, n]`` channels-last (the summed ``[B, n, dim]`` is that layout's
        memory: a view, then a 1x1 conv)."""
        summed = sum(layer._codebook.vectors()[codes[..., i]] for i, layer in enumerate(self.vq.layers))
        return conv1d_in_layout(from_rows(summed, channels_last), self.output_proj.weight)


class SplitQuantizer(nn.Module):
    """Code group 0 (semantic) and groups 1.. (acoustic) through separate quantizers."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        dim, size = config.codebook_dim // 2, config.codebook_size
        self.rvq_first = ResidualQuantizer(1, size, dim, config.codebook_dim)
        self.rvq_rest = ResidualQuantizer(config.num_quantizers - 1, size, dim, config.codebook_dim)

    def forward(self, codes: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
        """``codes [B, n, G]`` -> ``[B, codebook_dim, n]`` (``[B, codebook_dim, 1, n]``
        channels-last with ``channels_last``)."""
        first = self.rvq_first(codes[..., :1], channels_last)
        return first + self.rvq_rest(codes[..., 1:], channels_last)


class SpeechTokenizerDecoder(CarriedStateVocoder):
    """The 12 Hz tokenizer's decoder: split quantizer, causal conv, window transformer
    with projections, then the shared upsampler and vocoder."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.quantizer = SplitQuantizer(c)
        self.pre_conv = CausalConv(c.codebook_dim, c.latent_dim, 3)
        self.pre_transformer = PreTransformer(c)
        self._build_vocoder(c)
        self._number_states()

    def latents(self, codes: torch.Tensor, carry: Carry) -> torch.Tensor:
        h = self.pre_conv(self.quantizer(codes, self.channels_last), carry)
        return from_rows(self.pre_transformer(to_rows(h), carry), self.channels_last)


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


