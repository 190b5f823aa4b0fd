"""Random toy checkpoints (``omnistage init-random --arch ToySpeechForTesting``): a
``config.json`` naming the architecture, the voices (name -> base pitch in Hz) and the
harmonic amplitudes, drawn from the seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCHITECTURE = "ToySpeechForTesting"
SIZES = ("tiny", "small")
HARMONICS = {"tiny": 4, "small": 16}
VOICES = {"low": 110.0, "high": 330.0}


def write_toy_checkpoint(out_dir: Path, size: str, model_type: str | None, seed: int = 0, device: str = "cpu") -> Path:
    """Write ``out_dir/config.json``; ``model_type`` is None (one type), ``device`` unused
    (nothing is drawn on a device). Returns ``out_dir``."""
    assert model_type is None, "the toy model has one type"
    amplitudes = np.random.default_rng(seed).uniform(0.1, 1.0, HARMONICS[size])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [ARCHITECTURE], "voices": VOICES, "harmonics": amplitudes.round(6).tolist()}
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out
