"""Random-weight speech tokenizers in the real ``speech_tokenizer/`` layout.

``tiny`` has the dimensions of shared/reference/qwen3-tts.md section 9 (the official
reference loads it; 3.9 MB, < 1 s on CPU), ``0.6b`` / ``1.7b`` the real ones (both sizes
share one tokenizer: 170.6 M parameters, 682 MB fp32). Every tensor is random, because
the reference's defaults leave zero codebooks and zero SnakeBeta parameters that would let
broken code pass: codebook usage in [0.5, 2], SnakeBeta log-parameters ~ N(0, 0.1), norm
weights ~ 1 + N(0, 0.05), all other tensors ~ N(0, min(0.06, 1 / sqrt(fan_in))) (the
waveform conv min(0.06, 1.5 / fan_in)) so the decoder's output clamp at +-1 stays inactive
(fan-in scaling matters only at real dims: output std ~0.1 there, ~0.004 in tiny).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import (
    ARCHITECTURE,
    MODEL_TYPE,
    DecoderConfig,
    SpeechTokenizerConfig,
)
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import SpeechTokenizerDecoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.encoder import (
    SpeechTokenizerEncoder,
    checkpoint_name,
)

SIZES = ("tiny", "0.6b", "1.7b")
BASE_STD = 0.06
_TRANSPOSED_CONV = re.compile(r"^decoder\.(upsample\.\d+\.0|decoder\.\d+\.block\.1)\.conv\.weight$")

# Mimi's configuration as the released checkpoint states it (transformers 4.x names).
_MIMI_REAL: dict[str, Any] = {
    "model_type": "mimi", "sampling_rate": 24000, "_frame_rate": 12.5, "audio_channels": 1,
    "hidden_size": 512, "num_filters": 64, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4],
    "kernel_size": 7, "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2,
    "use_causal_conv": True, "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0,
    "codebook_size": 2048, "codebook_dim": 256, "num_quantizers": 32, "use_conv_shortcut": False,
    "vector_quantization_hidden_dimension": 256, "num_semantic_quantizers": 1, "upsample_groups": 512,
    "num_hidden_layers": 8, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "gelu", "max_position_embeddings": 8000, "initializer_range": 0.02,
    "norm_eps": 1e-05, "use_cache": False, "use_streaming": False, "rope_theta": 10000.0,
    "sliding_window": 250, "attention_dropout": 0.0, "layer_scale_initial_scale": 0.01, "attention_bias": False,
}  # fmt: skip
_MIMI_TINY = {
    "num_filters": 4, "hidden_size": 16, "num_hidden_layers": 1, "codebook_dim": 8,
    "vector_quantization_hidden_dimension": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 8, "intermediate_size": 32, "upsample_groups": 16,
}  # fmt: skip
_DECODER_TINY = {
    "codebook_dim": 16, "latent_dim": 16, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
    "decoder_dim": 32,
}  # fmt: skip
_PREPROCESSOR = {
    "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
    "overlap": None, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
    "sampling_rate": 24000,
}  # fmt: skip


def speech_tokenizer_config(size: str) -> dict[str, Any]:
    """The ``config.json`` content for ``size`` ("tiny", "0.6b", "1.7b").

    Raises:
        ValueError: unknown size.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    tiny = size == "tiny"
    decoder = {f: getattr(DecoderConfig(), f) for f in DecoderConfig.__dataclass_fields__}
    decoder.update(_DECODER_TINY if tiny else {})
    decoder.update(
        upsample_rates=list(decoder["upsample_rates"]), upsampling_ratios=list(decoder["upsampling_ratios"]),
        max_position_embeddings=8000, layer_scale_initial_scale=0.01, semantic_codebook_size=4096,
        num_semantic_quantizers=1, vector_quantization_hidden_dimension=decoder["codebook_dim"],
        attention_dropout=0.0,
    )  # fmt: skip
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "encoder_config": {**_MIMI_REAL, **(_MIMI_TINY if tiny else {})},
        "decoder_config": decoder,
    }


def _shapes(config: SpeechTokenizerConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, for every tensor the reference model holds."""
    with torch.device("meta"):
        encoder = SpeechTokenizerEncoder(config)
        decoder = SpeechTokenizerDecoder(config.decoder)
    shapes = {checkpoint_name(k): tuple(v.shape) for k, v in encoder.state_dict().items()}
    shapes.update({f"decoder.{k}": tuple(v.shape) for k, v in decoder.state_dict().items()})
    # the quantizers' encoding-side projections: in the checkpoint, unused for decoding
    half = config.decoder.codebook_dim // 2
    for part in ("rvq_first", "rvq_rest"):
        shapes[f"decoder.quantizer.{part}.input_proj.weight"] = (half, config.decoder.codebook_dim, 1)
    return shapes


def _random(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "cluster_usage":
        return torch.empty(shape).uniform_(0.5, 2.0, generator=generator)
    if leaf == "initialized":
        return torch.ones(shape)
    if leaf in ("alpha", "beta"):
        return torch.randn(shape, generator=generator) * 0.1
    if "norm" in name and leaf == "weight":
        return 1.0 + torch.randn(shape, generator=generator) * 0.05
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    if _TRANSPOSED_CONV.match(name):
        fan_in = shape[0] * shape[2]  # ConvTranspose1d stores [in, out, k]
    std = min(BASE_STD, 1.0 / math.sqrt(fan_in))
    if name.startswith("decoder.decoder.") and leaf == "weight" and shape[0] == 1:
        # the waveform conv's input carries SnakeBeta's accumulated offsets (std ~2 at real
        # dims): 1/sqrt(fan_in) clamped half the samples, 1.5/fan_in gives std ~0.1
        std = min(BASE_STD, 1.5 / fan_in)
    return torch.randn(shape, generator=generator) * std


def random_speech_tokenizer_tensors(size: str, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint name -> random fp32 tensor, deterministic for ``(size, seed)``.

    Raises:
        ValueError: unknown size.
    """
    config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config(size))
    generator = torch.Generator().manual_seed(seed)
    return {name: _random(name, shape, generator) for name, shape in sorted(_shapes(config).items())}


def write_random_speech_tokenizer(out_dir: Path, size: str, seed: int) -> None:
    """Write ``config.json``, ``model.safetensors`` and ``preprocessor_config.json`` of a
    random speech tokenizer into ``out_dir`` (created if missing).

    Raises:
        ValueError: unknown size.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = speech_tokenizer_config(size)
    tensors = random_speech_tokenizer_tensors(size, seed)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR, indent=2) + "\n")
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
