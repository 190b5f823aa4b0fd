"""Build Qwen3-Omni's thinker and talker from a checkpoint directory, from its safetensors or
with random weights made in place (``load_format="dummy"``, the vLLM/SGLang convention: the
real-size checkpoint, 65.7 GB, does not fit the GPU machine's 64 GiB disk, so a config alone
is enough to serve real dimensions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from omnistage.models.qwen3_omni.modeling.config import Qwen3OmniConfig, load_config
from omnistage.models.qwen3_omni.modeling.talker import Talker
from omnistage.models.qwen3_omni.modeling.thinker import Thinker
from omnistage.models.qwen3_omni.modeling.weights import (
    Part,
    fill_module,
    load_parts,
    random_source,
)

__all__ = ["LoadFormat", "LoadedOmni", "ModelPart", "load_model"]

LoadFormat = Literal["safetensors", "dummy"]
ModelPart = Literal["thinker", "talker"]


@dataclass
class LoadedOmni:
    """The loaded parts, eval mode, frozen; a part not asked for is None."""

    config: Qwen3OmniConfig
    thinker: Thinker | None
    talker: Talker | None


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
        ValueError: ``"talker"`` asked of a checkpoint without audio output, or an unknown
            part or load format.
    """
    config = load_config(checkpoint_dir)
    # bf16 on CUDA (the shipped checkpoint's dtype), fp32 elsewhere
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not 'safetensors' or 'dummy'")
    unknown = set(parts) - {"thinker", "talker"}
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: thinker, talker")
    if "talker" in parts and config.talker is None:
        raise ValueError("the checkpoint has no talker (enable_audio_output is false)")
    with torch.device("meta"):
        thinker = Thinker(config.thinker) if "thinker" in parts else None
        talker = Talker(config.talker) if "talker" in parts and config.talker is not None else None
    built = [Part(m, p) for m, p in ((thinker, "thinker."), (talker, "talker.")) if m is not None]
    if load_format == "dummy":
        source = random_source(seed, device)
        for part in built:
            fill_module(part.module, part.prefix, source, device, dtype)
    else:
        load_parts(checkpoint_dir, built, device, dtype)
    for part in built:
        part.module.eval().requires_grad_(False)
    if thinker is not None:
        thinker.model.reset_buffers(device)
    if talker is not None:
        talker.reset_buffers(device)
    return LoadedOmni(config=config, thinker=thinker, talker=talker)
