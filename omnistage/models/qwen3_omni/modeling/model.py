"""Build Qwen3-Omni's parts (thinker, talker, encoders, code2wav) from a checkpoint directory, from its safetensors or
with random weights made in place (``load_format="dummy"``, the vLLM/SGLang convention: the
real-size checkpoint, 65.7 GB, does not fit the GPU machine's 64 GiB disk, so a config alone
is enough to serve real dimensions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from omnistage.models.qwen3_omni.modeling.audio_encoder import AudioEncoder
from omnistage.models.qwen3_omni.modeling.code2wav import Code2Wav
from omnistage.models.qwen3_omni.modeling.config import Qwen3OmniConfig, load_config
from omnistage.models.qwen3_omni.modeling.random_init import CODE2WAV_GAINS, random_state_dict
from omnistage.models.qwen3_omni.modeling.talker import Talker
from omnistage.models.qwen3_omni.modeling.thinker import Thinker
from omnistage.models.qwen3_omni.modeling.vision_encoder import VisionEncoder
from omnistage.models.qwen3_omni.modeling.weights import (
    Part,
    fill_module,
    load_parts,
    random_source,
)

__all__ = ["LOADABLE_PARTS", "PARTS", "LoadFormat", "LoadedOmni", "ModelPart", "load_model", "part_prefixes"]

LoadFormat = Literal["safetensors", "dummy"]
ModelPart = Literal["thinker", "talker", "audio_tower", "visual", "code2wav", "thinker_embed"]
PARTS: tuple[str, ...] = ("thinker", "talker", "audio_tower", "visual", "code2wav")
"""The checkpoint's parts (every tensor belongs to one)."""
LOADABLE_PARTS: tuple[str, ...] = (*PARTS, "thinker_embed")
""":data:`PARTS` and ``thinker_embed``: the thinker's token embedding alone (what a talker
placed away from the thinker needs of it: its prompt embeds text tokens)."""


@dataclass
class LoadedOmni:
    """The loaded parts, eval mode, frozen; a part not asked for is None."""

    config: Qwen3OmniConfig
    thinker: Thinker | None = None
    talker: Talker | None = None
    audio_tower: AudioEncoder | None = None
    visual: VisionEncoder | None = None
    code2wav: Code2Wav | None = None
    thinker_embed: nn.Embedding | None = None


def load_model(
    checkpoint_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    parts: Sequence[ModelPart] = ("thinker", "talker"),
    load_format: LoadFormat = "safetensors",
    seed: int = 0,
) -> LoadedOmni:
    """Args:
        checkpoint_dir: holds config.json (and, for ``"safetensors"``, the weights).
        device, dtype: where and in what the weights live (default: bf16 on CUDA, fp32 else).
        parts: which modules to build; the others' tensors are not read.
        load_format: ``"safetensors"`` reads the checkpoint; ``"dummy"`` draws every tensor on
            ``device`` from ``seed`` exactly as ``init-random`` would write it.

    Raises:
        CheckpointConfigError: config.json missing or invalid.
        CheckpointWeightsError: weights missing, unexpected or of the wrong shape.
        ValueError: ``"talker"`` or ``"code2wav"`` asked of a checkpoint without audio
            output, or an unknown part or load format.
    """
    config = load_config(checkpoint_dir)
    # bf16 on CUDA (the shipped checkpoint's dtype), fp32 elsewhere
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not 'safetensors' or 'dummy'")
    unknown = set(parts) - set(LOADABLE_PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {', '.join(LOADABLE_PARTS)}")
    for name in ("talker", "code2wav"):
        if name in parts and getattr(config, name) is None:
            raise ValueError(f"the checkpoint has no {name} (enable_audio_output is false)")
    modules = build_parts(config, parts)
    built = [Part(m, part_prefixes()[name]) for name, m in modules.items()]
    if load_format == "dummy":
        source = random_source(seed, device)
        for name, part in zip(modules, built, strict=True):
            if name in SEEDED_PARTS:
                state = random_state_dict(part.module, part_seed(seed, name), SEEDED_GAINS[name])
                part.module.load_state_dict(
                    {k: v.to(device, dtype) for k, v in state.items()}, strict=True, assign=True
                )
            else:
                fill_module(part.module, part.prefix, source, device, dtype)
    else:
        load_parts(checkpoint_dir, built, device, dtype)
    for part in built:
        part.module.eval().requires_grad_(False)
        reset = getattr(part.module, "reset_buffers", None)
        if reset is not None:  # computed RoPE tables (the encoders compute theirs per forward)
            reset(device)
    return LoadedOmni(config=config, **modules)


SEEDED_PARTS = ("audio_tower", "visual", "code2wav")
"""Parts whose random weights :func:`random_state_dict` draws (one generator per part, the
per-tensor gains of :data:`SEEDED_GAINS`); the others draw per name (:func:`random_source`)."""
SEEDED_GAINS: dict[str, dict[str, float] | None] = {
    "audio_tower": None,
    "visual": None,
    "code2wav": CODE2WAV_GAINS,
}


def part_prefixes() -> dict[str, str]:
    """Part -> checkpoint prefix of its tensors."""
    return {
        "thinker": "thinker.",
        "talker": "talker.",
        "audio_tower": "thinker.audio_tower.",
        "visual": "thinker.visual.",
        "code2wav": "code2wav.",
        "thinker_embed": "thinker.model.embed_tokens.",
    }


def part_seed(seed: int, part: str) -> int:
    """The random-init seed of a part of :data:`SEEDED_PARTS` (one stream per part)."""
    return seed * 10 + SEEDED_PARTS.index(part) + 1


def build_parts(config: Qwen3OmniConfig, parts: Sequence[str]) -> dict[str, torch.nn.Module]:
    """The modules of ``parts`` on the meta device, in :data:`LOADABLE_PARTS` order."""
    makers = {
        "thinker": lambda: Thinker(config.thinker),
        "talker": lambda: Talker(config.talker) if config.talker is not None else None,
        "audio_tower": lambda: AudioEncoder(config.thinker.audio),
        "visual": lambda: VisionEncoder(config.thinker.vision),
        "code2wav": lambda: Code2Wav(config.code2wav) if config.code2wav is not None else None,
        "thinker_embed": lambda: nn.Embedding(config.thinker.text.vocab_size, config.thinker.text.hidden_size),
    }
    with torch.device("meta"):
        built = {name: makers[name]() for name in LOADABLE_PARTS if name in parts}
    return {name: m for name, m in built.items() if m is not None}
