"""``omnistage init-random``: write a random-weight checkpoint in a model's real layout.

Architectures map to their writer by dotted path, imported only when chosen, so the CLI
does not import model code it does not run.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from omnistage.cli.options import fail

__all__ = ["WRITERS", "init_random"]

# architecture -> "module:function(out_dir, size, model_type, seed, device)"
WRITERS = {
    "Qwen3TTSForConditionalGeneration": "omnistage.models.qwen3_tts.random_checkpoint:write_random_checkpoint",
}


class Size(StrEnum):
    tiny = "tiny"
    b06 = "0.6b"
    b17 = "1.7b"


class ModelType(StrEnum):
    base = "base"
    custom_voice = "custom_voice"
    voice_design = "voice_design"


def init_random(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write (created; existing files are overwritten).")],
    arch: Annotated[str, typer.Option("--arch", help=f"Architecture: {', '.join(WRITERS)}.")] = "Qwen3TTSForConditionalGeneration",
    size: Annotated[Size, typer.Option("--size", help="tiny (tests, seconds on CPU) or a real size.")] = Size.tiny,
    model_type: Annotated[ModelType, typer.Option("--type", help="Model variant.")] = ModelType.base,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Same seed, device and torch build: same bytes.")] = 0,
    device: Annotated[str, typer.Option("--device", help="Where tensors are drawn: cpu or cuda (real sizes).")] = "cpu",
) -> None:
    """Write a random-weight checkpoint (configs, tokenizer, weights, speech tokenizer)."""
    if arch not in WRITERS:
        fail(f"unknown --arch {arch!r}; known: {', '.join(WRITERS)}")
    if device not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda, got {device!r}")
    module_name, _, function = WRITERS[arch].partition(":")
    writer = getattr(importlib.import_module(module_name), function)
    out = writer(out_dir, size.value, model_type.value, seed=seed, device=device)
    typer.echo(f"wrote {arch} ({size.value}, {model_type.value}, seed {seed}) to {out}")
