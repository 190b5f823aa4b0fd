"""Random-weight Qwen3-Omni checkpoints in the real layout (``init-random``), and the configs
``--load-format dummy`` serves from.

Sizes:

- ``tiny``: the geometry verified against transformers 5.24 (shared/reference/qwen3-omni-tiny-config.json:
  thinker hidden 64, 4 layers, 8 experts top-2; talker hidden 32, 2 layers, 4 experts top-2
  with a shared expert; code predictor 1 layer), fp32, transformers 5's ``rope_parameters``
  spelling. Real vocabularies and every real special / codec / speaker id.
- ``30b-a3b``: the real dimensions (digest section 1), bf16, the Hub's ``rope_scaling`` +
  ``rope_theta`` spelling. 65.7 GB: write it only where the disk allows; on the GPU machine
  serve it with ``--load-format dummy`` from :func:`write_config` alone instead.

Tensors are drawn one at a time (:func:`omnistage.models.qwen3_omni.modeling.weights.random_source`:
norm weights around 1, embeddings N(0, 1), matrices N(0, 1/fan_in), biases N(0, 0.02^2), each
from a generator seeded by ``(seed, crc32(name))``) and written shard by shard (2 GiB), so at
most one shard is in host memory; the same seed gives the same bytes as a dummy load draws.

Written parts: every part of the real checkpoint: the thinker's text model and LM head, the
talker with its code predictor (drawn per name), the audio and vision encoders and code2wav
(drawn by :func:`~omnistage.models.qwen3_omni.modeling.random_init.random_state_dict`, code2wav
with its residual / waveform gains, as a dummy load does).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import torch

from omnistage.checkpoint.safetensors_files import SHARD_BYTES, write_safetensors
from omnistage.models.qwen3_omni.modeling.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.modeling.model import (
    PARTS,
    SEEDED_GAINS,
    SEEDED_PARTS,
    build_parts,
    part_prefixes,
    part_seed,
)
from omnistage.models.qwen3_omni.modeling.random_init import random_state_dict
from omnistage.models.qwen3_omni.modeling.weights import checkpoint_shapes, random_source
from omnistage.models.qwen3_omni.random_text_tokenizer import (
    give_role_words_their_ids,
    write_text_tokenizer,
)
from omnistage.serve.model import RandomCheckpoint

__all__ = [
    "RANDOM_CHECKPOINT",
    "SIZES",
    "Size",
    "build_config_dict",
    "checkpoint_tensor_shapes",
    "write_config",
    "write_random_checkpoint",
]

Size = Literal["tiny", "30b-a3b"]
SIZES: tuple[str, ...] = ("tiny", "30b-a3b")
RANDOM_CHECKPOINT = RandomCheckpoint(
    writer="omnistage.models.qwen3_omni.random_checkpoint:write_random_checkpoint", sizes=SIZES
)
"""What ``EntryClass.random_checkpoint`` declares (``omnistage init-random``)."""

_IDS = {
    "im_start_token_id": 151644, "im_end_token_id": 151645, "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "system_token_id": 8948,
    "user_token_id": 872, "assistant_token_id": 77091,
}  # fmt: skip
_MM_IDS = {
    "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
    "audio_start_token_id": 151669, "vision_start_token_id": 151652, "position_id_per_seconds": 13,
}  # fmt: skip
_CODEC_IDS = {
    "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
}  # fmt: skip
_SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
_MROPE = {"mrope_section": [24, 20, 20], "interleaved": True, "mrope_interleaved": True}


def _decoder(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> dict:
    return {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 65536, "attention_bias": False,
    }  # fmt: skip


def _real_config() -> dict:
    thinker_text = _decoder(2048, 6144, 48, 32, 4, 152064)
    thinker_text.update({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                         "rope_theta": 1000000.0, "rope_scaling": {"type": "default", **_MROPE}})  # fmt: skip
    talker_text = _decoder(1024, 2048, 20, 16, 2, 3072)
    talker_text.update({"num_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 384,
                        "shared_expert_intermediate_size": 768, "norm_topk_prob": True,
                        "rope_theta": 1000000.0, "rope_scaling": {"type": "default", **_MROPE}})  # fmt: skip
    predictor = _decoder(1024, 3072, 5, 16, 8, 2048)
    predictor.update({"num_code_groups": 16, "rope_theta": 1000000.0})
    audio = {"num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
             "d_model": 1280, "output_dim": 2048, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
             "downsample_hidden_size": 480, "max_source_positions": 1500}  # fmt: skip
    vision = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2048,
              "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}  # fmt: skip
    code2wav = {"codebook_size": 2048, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16,
                "intermediate_size": 3072, "num_hidden_layers": 8, "num_quantizers": 16, "sliding_window": 72,
                "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 1536,
                "max_position_embeddings": 8000, "rope_theta": 10000.0}  # fmt: skip
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
        "enable_audio_output": True, "torch_dtype": "bfloat16",
        "thinker_config": {**_MM_IDS, "user_token_id": 872, "text_config": thinker_text,
                           "audio_config": audio, "vision_config": vision},
        "talker_config": {**_MM_IDS, **_CODEC_IDS, "num_code_groups": 16, "thinker_hidden_size": 2048,
                          "accept_hidden_layer": 24, "spatial_merge_size": 2, "speaker_id": dict(_SPEAKERS),
                          "text_config": talker_text, "code_predictor_config": predictor},
        "code2wav_config": code2wav,
        **_IDS,
    }  # fmt: skip


def _tiny_config() -> dict:
    """shared/reference/qwen3-omni-tiny-config.json (verified to build, generate and round-trip
    in transformers 5.24)."""
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2], "interleaved": True,
            "mrope_interleaved": True}  # fmt: skip
    common = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2}  # fmt: skip
    thinker_text = {**common, "vocab_size": 152064, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                    "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_parameters": dict(rope)}  # fmt: skip
    talker_text = {**common, "vocab_size": 3072, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "rope_parameters": dict(rope)}  # fmt: skip
    predictor = {**common, "vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_code_groups": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}  # fmt: skip
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "d_model": 32,
             "output_dim": 64, "n_window": 50, "n_window_infer": 800, "downsample_hidden_size": 32,
             "max_source_positions": 1500}  # fmt: skip
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0, 1]}  # fmt: skip
    code2wav = {"codebook_size": 2048, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                "intermediate_size": 64, "num_hidden_layers": 1, "num_quantizers": 16, "sliding_window": 72,
                "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32,
                "max_position_embeddings": 8000, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
        "enable_audio_output": True, "torch_dtype": "float32",
        "thinker_config": {**_MM_IDS, "user_token_id": 872, "text_config": thinker_text,
                           "audio_config": audio, "vision_config": vision},
        "talker_config": {**_MM_IDS, **_CODEC_IDS, "num_code_groups": 16, "thinker_hidden_size": 64,
                          "accept_hidden_layer": 2, "spatial_merge_size": 2, "speaker_id": dict(_SPEAKERS),
                          "text_config": talker_text, "code_predictor_config": predictor},
        "code2wav_config": code2wav,
        **_IDS,
    }  # fmt: skip


def build_config_dict(size: Size) -> dict:
    """The config.json contents for ``size``. Raises: KeyError on an unknown size."""
    builders = {"tiny": _tiny_config, "30b-a3b": _real_config}
    if size not in builders:
        raise KeyError(f"unknown size {size!r}; one of {SIZES}")
    return copy.deepcopy(builders[size]())


def _dtype(size: Size) -> torch.dtype:
    return torch.float32 if size == "tiny" else torch.bfloat16


def checkpoint_tensor_shapes(raw: dict) -> dict[str, torch.Size]:
    """Name -> shape of every tensor a checkpoint of config ``raw`` holds in the written parts
    (built on the meta device, no memory). Raises: CheckpointConfigError on a bad config."""
    config = Qwen3OmniConfig.from_dict(raw)
    shapes: dict[str, torch.Size] = {}
    for name, module in build_parts(config, PARTS).items():
        shapes.update(checkpoint_shapes(module, part_prefixes()[name]))
    return shapes


def _seeded_tensors(raw: dict, seed: int) -> dict[str, torch.Tensor]:
    """The random tensors of the encoders and code2wav (:data:`SEEDED_PARTS`) under their
    prefixes, drawn as a dummy load draws them."""
    config = Qwen3OmniConfig.from_dict(raw)
    tensors = {}
    for name, module in build_parts(config, SEEDED_PARTS).items():
        prefix = part_prefixes()[name]
        tensors.update(
            {prefix + k: v for k, v in random_state_dict(module, part_seed(seed, name), SEEDED_GAINS[name]).items()}
        )
    return tensors


def write_config(out_dir: str | Path, size: Size) -> Path:
    """Only config.json (what ``--load-format dummy`` needs). Returns ``out_dir`` as a Path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps(build_config_dict(size), indent=2), encoding="utf-8"
    )
    return out


def write_random_checkpoint(
    out_dir: str | Path,
    size: Size,
    model_type: None = None,
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """config.json, a text tokenizer with the real special and role ids
    (:mod:`.random_text_tokenizer`) and random weights of every part (``model.safetensors``,
    or 2 GiB shards and ``model.safetensors.index.json``), so the checkpoint serves as it is:
    the ``init-random`` writer
    (:data:`RANDOM_CHECKPOINT`). Returns ``out_dir`` as a Path.

    Args:
        model_type: must be None (Qwen3-Omni has one type; the CLI refuses ``--type``).
        seed: same seed, device and torch build: same bytes.
        device: where the per-name tensors are drawn (``"cuda"`` for the real size).

    Raises: KeyError on an unknown size; ValueError on a model type."""
    if model_type is not None:
        raise ValueError(f"Qwen3-Omni has one model type; got model_type {model_type!r}")
    out = write_config(out_dir, size)
    write_text_tokenizer(out)
    give_role_words_their_ids(out)
    raw = build_config_dict(size)
    dtype = _dtype(size)
    shapes = checkpoint_tensor_shapes(raw)
    source = random_source(seed, device)
    seeded = _seeded_tensors(raw, seed)
    # SHARD_BYTES read here, at call time: the sharding test shrinks this module's name
    write_safetensors(
        out, shapes, dtype, lambda name: seeded[name] if name in seeded else source(name, shapes[name]), SHARD_BYTES
    )
    return out
