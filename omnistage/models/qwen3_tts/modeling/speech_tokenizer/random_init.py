"""Random-weight speech tokenizers in the real ``speech_tokenizer/`` layout.

``tiny`` has the dimensions of shared/reference/qwen3-tts.md section 9 (the official
reference loads it; 3.9 MB, < 1 s on CPU), ``0.6b`` / ``1.7b`` the real ones (both sizes
share one tokenizer: 170.6 M parameters, 682 MB fp32). Every tensor is random, because
the reference's defaults leave zero codebooks and zero SnakeBeta parameters that would let
broken code pass: codebook usage in [0.5, 2], SnakeBeta log-parameters ~ N(0, 0.1), norm
weights ~ 1 + N(0, 0.05).

The decoder's other tensors are scaled so that its output depends on the codes at every
size (see :func:`_decoder_std`): weights ~ N(0, gain^2 / fan_in) with the fan-in a layer's
output really sums over, small biases. Output for random codes: std ~0.07 (tiny) / ~0.08
(0.6b), peak ~0.4, and two different code sequences differ by ~0.4 at most (std ~1.2x the
output's): audio compared at 1 int16 step tells right codes from wrong ones, and the
output clamp at +-1 stays inactive.

The encoder's tensors are scaled so that its codes depend on the audio (see
:func:`_encoder_std`): the same fan-in rule with gains for the ELUs and residual units, the
first conv scaled for audio at rms ~0.2, and codebook vectors at the scale of the residual
each quantizer stage sees. A 1 s clip's 13 frames take ~12 distinct codes in each of the 16
groups, and two different clips share ~1% of their codes (tiny and 0.6b).
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


# Decoder scaling (measured, seed 0, 100 random frames). The older rule, N(0, min(0.06,
# 1 / sqrt(fan_in))) for every tensor, left the tiny decoder's output to its biases: with
# fan-ins of 8..112 the 0.06 cap made every layer's gain 0.2..0.6 while each added a
# bias of std 0.06, and the transposed convs were scaled by in * kernel although each
# output sums only in * kernel / stride taps. The code-dependent part fell from 1.4x the
# total std at the quantizer to 0.10x after the transformer's input projection, 0.01x
# after the upsampling, 0.0003x at the waveform (max difference 6e-6, 1/5 of an int16
# step; output peak 0.013). Now:
# - codebook vectors ~ N(0, 1) (an embedding table), every weight ~ N(0, gain^2 / fan_in)
#   (variance-preserving: LeCun), biases ~ N(0, 0.02): the code signal keeps its level
#   through the quantizer, the convs and the transformer (its final RMSNorm rescales it);
# - a transposed conv's fan-in is in_channels * kernel / stride (upsample: kernel =
#   stride, vocoder blocks: kernel = 2 * stride);
# - the vocoder's 12 residual units end in a 1x1 conv of gain 0.3 (Fixup-style residual
#   down-scaling): at gain 1 every unit doubles the variance (x + branch, and SnakeBeta
#   adds sin^2 offsets), 4 blocks grew the activations ~80x and clamped the output;
#   at 0.3 the waveform conv's input has rms ~2.4 at both sizes;
# - the waveform conv has gain 0.03: output std ~0.07 (tiny) / ~0.08 (0.6b), peak ~0.4
#   (tiny's waveform conv sums only 14 weights, so the level varies with the seed: peak
#   <= 0.75 over seeds 0..7).
# LayerScale / ConvNeXt gamma stay ~ N(0, 0.06) (the released init is 0.01): the
# transformer branches still move the tiny waveform by ~13% of its peak.
DECODER_BIAS_STD = 0.02
RESIDUAL_BRANCH_GAIN = 0.3
WAVEFORM_GAIN = 0.03
LAYER_SCALE_STD = 0.06
# transposed convs, by checkpoint name -> taps each output sums per input channel
_TRANSPOSED_TAPS = ((re.compile(r"^decoder\.upsample\.\d+\.0\.conv\.weight$"), 1),
                    (re.compile(r"^decoder\.decoder\.\d+\.block\.1\.conv\.weight$"), 2))  # fmt: skip
_RESIDUAL_OUT = re.compile(r"^decoder\.decoder\.\d+\.block\.\d+\.conv2\.conv\.weight$")


def _decoder_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of a decoder tensor other than codebook usage, SnakeBeta and
    norm weights (see the comment above)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "embedding_sum":
        return 1.0
    if leaf in ("scale", "gamma"):
        return LAYER_SCALE_STD
    if len(shape) == 1:
        return DECODER_BIAS_STD
    fan_in = math.prod(shape[1:])
    for pattern, taps in _TRANSPOSED_TAPS:
        if pattern.match(name):
            fan_in = shape[0] * taps  # ConvTranspose1d stores [in, out, k]
    gain = 1.0
    if _RESIDUAL_OUT.match(name):
        gain = RESIDUAL_BRANCH_GAIN
    elif name.startswith("decoder.decoder.") and shape[0] == 1:
        gain = WAVEFORM_GAIN
    return gain / math.sqrt(fan_in)


# Encoder scaling (measured, seed 0, 1 s clips at 24 kHz: a 220 Hz tone + noise vs a 523 Hz
# tone + other noise; "share" = rms of the difference between the clips' activations / rms
# of the activations; ~1.4 for unrelated signals). The older rule, N(0, min(0.06,
# 1 / sqrt(fan_in))) for every tensor, gave each tiny SEANet conv (fan-ins 7..512) a gain
# of 0.16..0.6 while adding biases of std 0.06: the share fell from 1.1 after the first
# conv to 0.36 after the first strided conv, 0.14 / 0.10 / 0.07 after the next ones and
# at the latents (std 0.05, mostly bias offsets); the quantizer's projections (gain 0.24)
# left latents of std 0.006..0.011 against codebook vectors of std 0.03..0.12
# (embed_sum ~ N(0, 0.06) / usage in [0.5, 2]): the nearest codeword was the one of
# smallest norm whatever the audio, so a clip's 13 frames took 3..7 distinct codes per
# group and two different clips shared 69% of their codes. Now, at every size:
# - every weight ~ N(0, gain^2 / fan_in) (fan-in = in_channels * kernel: a strided conv's
#   output sums all its taps), gain ELU_GAIN after an ELU (an ELU keeps E[y^2] = 0.645 of
#   a unit Gaussian's), 1 elsewhere, and 1 / ENCODER_AUDIO_RMS for the first conv: audio
#   at rms ~0.2 gives activations of rms ~1; biases (LayerNorm's too) ~ N(0, 0.02);
# - each residual unit's last conv has an extra gain 0.5 (x + branch grows the variance
#   by 1.25 per unit, not 2); LayerScale ~ N(0, 0.06) as in the decoder;
# - codebook k of an RVQ (dimension dim, 2048 vectors) sees a residual of rms
#   ~LATENT_RMS * rho^k per coordinate, rho = 2048^(-RVQ_EFFICIENCY / dim), and its
#   vectors have rms sqrt(1 - rho^2) times that (the reconstruction's share under reverse
#   water-filling); ``embed_sum`` = vector * usage, so that the reference's
#   ``embed_sum / usage`` gives exactly those vectors. The rate-distortion bound is
#   efficiency 1; random Gaussian codebooks reach ~0.8 for the first stages (residual
#   rms x0.47 per stage at dim 8, x0.977 at dim 256), but at 0.8 the tiny residual
#   stalled after 5 stages (the outliers a small codebook cannot reach); 0.5 keeps it
#   shrinking (x0.5..0.65 per stage through stage 15 at dim 8).
# LATENT_RMS is the projected latents' measured rms for audio at rms 0.2: 1.1 (0.6b),
# 0.8..2.5 (tiny, seeds 0..3; its 16-channel layers vary with the seed).
# Result (audio at rms 0.2): the share stays 0.9..1.5 through every stage at both sizes;
# 16 groups x 13 frames take 12..13 distinct codes per group (mean >= 12.2; the 523 Hz
# tone's first groups 9..11), two different clips share 0..2% of their codes (the same
# tones with other noise: 2..25%).
ENCODER_AUDIO_RMS = 0.2
ENCODER_BIAS_STD = 0.02
ELU_GAIN = 1.25
ENCODER_RESIDUAL_GAIN = 0.5
LATENT_RMS = 1.5  # between 0.6b's 1.1 and tiny's ~1.6 (seed 0)
RVQ_EFFICIENCY = 0.5
_ENCODER_FIRST_CONV = "encoder.encoder.layers.0.conv.weight"
# every SEANet conv but the first follows an ELU
_ENCODER_AFTER_ELU = re.compile(r"^encoder\.encoder\.layers\.(?!0\.)\d+\.")
_ENCODER_RESIDUAL_OUT = re.compile(r"^encoder\.encoder\.layers\.\d+\.block\.3\.conv\.weight$")
_CODEBOOK = re.compile(r"\.layers\.(\d+)\.codebook\.embed_sum$")


def _codebook_std(name: str, shape: tuple[int, ...]) -> float:
    """Per-coordinate std of an encoder codebook's vectors (see the comment above)."""
    stage = int(_CODEBOOK.search(name).group(1))  # type: ignore[union-attr]
    dim = shape[1]
    rho = shape[0] ** (-RVQ_EFFICIENCY / dim)
    residual_rms = LATENT_RMS * rho**stage  # per coordinate
    return residual_rms * math.sqrt(1.0 - rho**2)


def _encoder_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of an encoder tensor other than codebook usage and norm
    weights (see the comment above)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "embed_sum":
        return _codebook_std(name, shape)
    if leaf == "scale":
        return LAYER_SCALE_STD
    if len(shape) == 1:
        return ENCODER_BIAS_STD
    gain = 1.0
    if name == _ENCODER_FIRST_CONV:
        gain = 1.0 / ENCODER_AUDIO_RMS
    elif _ENCODER_AFTER_ELU.match(name):
        gain = ELU_GAIN * (ENCODER_RESIDUAL_GAIN if _ENCODER_RESIDUAL_OUT.match(name) else 1.0)
    return gain / math.sqrt(math.prod(shape[1:]))


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
    if name.startswith("decoder."):
        return torch.randn(shape, generator=generator) * _decoder_std(name, shape)
    return torch.randn(shape, generator=generator) * _encoder_std(name, shape)


def random_speech_tokenizer_tensors(size: str, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint name -> random fp32 tensor, deterministic for ``(size, seed)``.

    Raises:
        ValueError: unknown size.
    """
    config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config(size))
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: _random(name, shape, generator) for name, shape in sorted(_shapes(config).items())}
    for name, tensor in tensors.items():  # the encoder's codebook vectors are embed_sum / usage
        if name.startswith("encoder.") and name.endswith(".embed_sum"):
            tensor.mul_(tensors[name.removesuffix("embed_sum") + "cluster_usage"][:, None])
    return tensors


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
