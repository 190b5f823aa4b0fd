"""Shared helpers of the talker tests: the reference fixture file and checkpoint digests."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

FIXTURE = Path(__file__).parent / "fixtures" / "talker_reference.safetensors"
SEED = 0  # the seed the fixture's checkpoints were written with
MODEL_TYPES = ("base", "custom_voice", "voice_design")


@dataclass
class ReferenceFixture:
    """What ``tools/parity/qwen3_tts_talker_reference.py`` wrote."""

    tensors: dict[str, torch.Tensor]
    frames: int
    digests: dict[str, str]
    cases: dict[str, dict]

    @classmethod
    def load(cls) -> ReferenceFixture:
        with safe_open(str(FIXTURE), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            meta = json.loads(f.metadata()["meta"])
        return cls(tensors=tensors, frames=meta["frames"], digests=meta["digests"], cases=meta["cases"])


def weights_digest(checkpoint_dir: Path) -> str:
    """sha256 of the checkpoint's model.safetensors."""
    return hashlib.sha256((checkpoint_dir / "model.safetensors").read_bytes()).hexdigest()
