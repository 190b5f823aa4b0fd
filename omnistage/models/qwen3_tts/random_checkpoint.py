"""Random-weight Qwen3-TTS checkpoints in the real layout (``omnistage init-random``).

A checkpoint has the real files (digest section 1): config.json (real special ids, real
``rope_scaling`` form, int and 1-element-list ``spk_id`` entries), generation_config.json
(the 10 keys), a byte-level BPE text tokenizer, model.safetensors (sharded with an index
above 2 GB), preprocessor_config.json and ``speech_tokenizer/``. Sizes:

- ``tiny``: the digest's section 9 geometry (talker hidden 32, 2 layers, 4 heads / 2 kv,
  head_dim 8; predictor hidden 24, 1 layer; text hidden 48), fp32, ~1 MB of talker weights;
  loads in the reference code. Codec vocabulary and every codec/language/speaker id are real.
- ``0.6b`` and ``1.7b``: the real dims (28 layers, head_dim 128, text vocab 151936 x 2048),
  bf16. Create them on a GPU (``--device cuda``): tensors are drawn one at a time on the
  device and written shard by shard, so at most one shard is in host memory.

Every tensor is random (norm weights around 1, embeddings N(0, 1), matrices N(0, 1/fan_in),
biases N(0, 0.02^2)) so activations stay finite and differences are not hidden. Tensor ``name``
is drawn from a generator seeded by ``(seed, crc32(name))``: the same seed, device and torch
build give the same bytes, independent of shard layout.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from omnistage.checkpoint.safetensors_files import write_safetensors
from omnistage.checkpoint.text_tokenizer import base_vocab_size, write_text_tokenizer
from omnistage.models.qwen3_tts.modeling.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.modeling.model import Qwen3TTSModel

__all__ = ["SIZES", "TYPES", "build_config_dict", "write_model_files", "write_random_checkpoint"]

Size = Literal["tiny", "0.6b", "1.7b"]
ModelType = Literal["base", "custom_voice", "voice_design"]
SIZES: tuple[str, ...] = ("tiny", "0.6b", "1.7b")
TYPES: tuple[str, ...] = ("base", "custom_voice", "voice_design")
REAL_SPECIAL_START = 151643  # <|endoftext|> of the Qwen2/3 tokenizer

# Real ids (digest section 1).
LANGUAGES = {
    "english": 2050, "german": 2053, "spanish": 2054, "chinese": 2055, "japanese": 2058,
    "french": 2061, "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071,
}
DIALECTS = {"sichuan_dialect": 2062, "beijing_dialect": 2074}
SPEAKERS = {
    "aiden": 2861, "sohee": 2864, "ono_anna": 2873, "eric": 2875, "dylan": 2878,
    "uncle_fu": 3010, "ryan": 3061, "vivian": 3065, "serena": 3066,
}
SPEAKER_DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
GENERATION_CONFIG = {
    "do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
    "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
    "subtalker_temperature": 0.9, "max_new_tokens": 8192,
}


@dataclass(frozen=True)
class _Geometry:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]
    text_hidden: int
    predictor_hidden: int
    predictor_intermediate: int
    predictor_layers: int
    predictor_heads: int
    predictor_kv_heads: int
    predictor_head_dim: int
    enc_channels: tuple[int, ...]
    enc_attention_channels: int
    enc_se_channels: int
    enc_res2net_scale: int
    model_size: str
    dtype: torch.dtype


_REAL_PREDICTOR = {"predictor_hidden": 1024, "predictor_intermediate": 3072, "predictor_layers": 5,
                   "predictor_heads": 16, "predictor_kv_heads": 8, "predictor_head_dim": 128}
_REAL_ECAPA = {"enc_channels": (512, 512, 512, 512, 1536), "enc_attention_channels": 128,
               "enc_se_channels": 128, "enc_res2net_scale": 8}
GEOMETRIES: dict[str, _Geometry] = {
    "tiny": _Geometry(
        hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8, mrope_section=(2, 1, 1),
        text_hidden=48, predictor_hidden=24, predictor_intermediate=48, predictor_layers=1,
        predictor_heads=4, predictor_kv_heads=2, predictor_head_dim=8,
        enc_channels=(16, 16, 16, 16, 48), enc_attention_channels=8, enc_se_channels=8,
        enc_res2net_scale=4, model_size="tiny", dtype=torch.float32,
    ),
    "0.6b": _Geometry(
        hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128, mrope_section=(24, 20, 20),
        text_hidden=2048, model_size="0b6", dtype=torch.bfloat16, **_REAL_PREDICTOR, **_REAL_ECAPA,
    ),
    "1.7b": _Geometry(
        hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128, mrope_section=(24, 20, 20),
        text_hidden=2048, model_size="1b7", dtype=torch.bfloat16, **_REAL_PREDICTOR, **_REAL_ECAPA,
    ),
}


def _decoder_dict(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    return {
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
        "use_sliding_window": False, "max_position_embeddings": 32768, "initializer_range": 0.02,
        "use_cache": True, "attention_dropout": 0.0,
    }


def build_config_dict(size: Size, model_type: ModelType) -> dict:
    """The config.json contents for ``size`` and ``model_type``.

    Raises: KeyError on an unknown size.
    """
    g = GEOMETRIES[size]
    special_start = base_vocab_size() if size == "tiny" else REAL_SPECIAL_START
    text_vocab = special_start + 31 if size == "tiny" else 151936
    custom = model_type == "custom_voice"
    talker = _decoder_dict(g.hidden, g.intermediate, g.layers, g.heads, g.kv_heads, g.head_dim)
    talker.update({
        "vocab_size": 3072, "text_vocab_size": text_vocab, "text_hidden_size": g.text_hidden,
        "num_code_groups": 16,
        "rope_scaling": {"rope_type": "default", "mrope_section": list(g.mrope_section), "interleaved": True},
        "codec_eos_token_id": 2150, "codec_think_id": 2154, "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
        "codec_language_id": {**LANGUAGES, **(DIALECTS if custom else {})},
        # both spellings occur in shipped configs: an int, or a 1-element list
        "spk_id": {name: ([i] if n % 2 else i) for n, (name, i) in enumerate(SPEAKERS.items())} if custom else {},
        "spk_is_dialect": {name: SPEAKER_DIALECTS.get(name, False) for name in SPEAKERS} if custom else {},
    })
    predictor = _decoder_dict(g.predictor_hidden, g.predictor_intermediate, g.predictor_layers,
                              g.predictor_heads, g.predictor_kv_heads, g.predictor_head_dim)
    predictor.update({"vocab_size": 2048, "num_code_groups": 16})
    talker["code_predictor_config"] = predictor
    n = len(g.enc_channels)
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": g.model_size,
        "tts_model_type": model_type,
        "im_start_token_id": special_start + 1,
        "im_end_token_id": special_start + 2,
        "tts_pad_token_id": special_start + 28,
        "tts_bos_token_id": special_start + 29,
        "tts_eos_token_id": special_start + 30,
        "torch_dtype": "float32" if g.dtype == torch.float32 else "bfloat16",
        "talker_config": talker,
        # only keys the reference's speaker-encoder config accepts (it has no **kwargs)
        "speaker_encoder_config": {
            "mel_dim": 128, "enc_dim": g.hidden, "enc_channels": list(g.enc_channels),
            "enc_kernel_sizes": [5, *([3] * (n - 2)), 1], "enc_dilations": [1, *range(2, n), 1],
            "enc_attention_channels": g.enc_attention_channels, "enc_res2net_scale": g.enc_res2net_scale,
            "enc_se_channels": g.enc_se_channels, "sample_rate": 24000,
        },
    }


def _random_tensor(name: str, shape: torch.Size, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        x = 1.0 + 0.1 * x
    elif len(shape) == 1:
        x = 0.02 * x
    elif "embedding" not in name:
        x = x / math.sqrt(math.prod(shape[1:]))
    return x.to(dtype)


def write_model_files(out_dir: str | Path, size: Size, model_type: ModelType, seed: int = 0, device: str = "cpu") -> Path:
    """Everything except ``speech_tokenizer/``: configs, text tokenizer, weights.

    Returns ``out_dir`` as a Path. Raises: KeyError on an unknown size or type.
    """
    if model_type not in TYPES:
        raise KeyError(f"unknown model type {model_type!r}; one of {TYPES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = build_config_dict(size, model_type)
    special_start = raw["im_start_token_id"] - 1
    write_text_tokenizer(out, special_start)
    (out / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2), encoding="utf-8")
    (out / "preprocessor_config.json").write_text(
        json.dumps({"processor_class": "Qwen3TTSProcessor", "sampling_rate": 24000}, indent=2), encoding="utf-8"
    )
    dtype = GEOMETRIES[size].dtype
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Qwen3TTSModel(Qwen3TTSConfig.from_dict(raw)).state_dict().items()}
    write_safetensors(out, shapes, dtype, lambda name: _random_tensor(name, shapes[name], seed, dtype, device))
    return out


def write_random_checkpoint(out_dir: str | Path, size: Size, model_type: ModelType, seed: int = 0, device: str = "cpu") -> Path:
    """A complete checkpoint: :func:`write_model_files` plus ``speech_tokenizer/`` (from the
    speech tokenizer package's random init, same size and seed)."""
    from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
        write_random_speech_tokenizer,
    )

    out = write_model_files(out_dir, size, model_type, seed, device)
    write_random_speech_tokenizer(out / "speech_tokenizer", size, seed)
    return out
