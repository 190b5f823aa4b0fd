"""Deterministic random weights for Qwen3-Omni modules (parity fixtures, tiny checkpoints).

Every tensor is random (the reference's zero SnakeBeta parameters or unit norms would let
broken code pass) and scaled so that outputs depend on inputs at every depth:

- Linear / Conv weights ~ N(0, gain^2 / fan_in) (LeCun, variance-preserving), where the
  fan-in is what one output really sums: ``in * kernel / groups``, and for a transposed
  conv ``in * kernel / stride``; ``gain`` 1 unless the caller names a tensor's gain;
- biases ~ N(0, 0.02); embeddings ~ N(0, 1); norm weights ~ 1 + N(0, 0.05);
- SnakeBeta log-parameters ~ N(0, 0.1); LayerScale / ConvNeXt gamma ~ N(0, 0.06).

For code2wav pass :data:`CODE2WAV_GAINS` (Qwen3-TTS's measured rule for the same vocoder:
speech_tokenizer/random_init.py): each residual unit's last 1x1 conv at gain 0.3 (at 1,
12 units grow the activations ~80x and clamp the output) and the waveform conv at 0.03;
the tiny code2wav then gives std ~0.06, peak ~0.3, and other codes change it by ~0.4.

Tensors are drawn in sorted-name order from one ``torch.Generator`` seeded with ``seed``,
so the same (module structure, seed) gives the same tensors on every machine.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

BIAS_STD = 0.02
NORM_WEIGHT_STD = 0.05
SNAKE_STD = 0.1
LAYER_SCALE_STD = 0.06
_SCALES = ("scale", "gamma")  # LayerScale.scale, ConvNeXt gamma
CODE2WAV_GAINS = {
    r"decoder\.\d+\.block\.\d+\.conv2\.conv\.weight": 0.3,  # residual units' last conv
    r"decoder\.(?!0\.)\d+\.conv\.weight": 0.03,  # the waveform conv (decoder.0 is the input conv)
}


def random_state_dict(
    module: nn.Module, seed: int, gains: dict[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """Random fp32 tensors for every entry of ``module.state_dict()`` (same names and shapes).

    Args:
        module: the module (may live on the meta device).
        seed: the generator's seed.
        gains: regular expression (``re.fullmatch`` on the tensor name) -> gain for the
            weights it matches; the first matching pattern wins.

    Returns:
        name -> tensor, for ``module.load_state_dict(..., strict=True)``.
    """
    owners = dict(module.named_modules())
    generator = torch.Generator().manual_seed(seed)
    patterns = [(re.compile(p), g) for p, g in (gains or {}).items()]
    out = {}
    for name, tensor in sorted(module.state_dict().items()):
        owner_name, _, leaf = name.rpartition(".")
        shape = tuple(tensor.shape)
        gain = next((g for p, g in patterns if p.fullmatch(name)), 1.0)
        std = _std(owners[owner_name], leaf, shape, gain)
        base = 1.0 if leaf == "weight" and _is_norm(owners[owner_name]) else 0.0
        out[name] = base + torch.randn(shape, generator=generator) * std
    return out


def _is_norm(owner: nn.Module) -> bool:
    return isinstance(owner, nn.LayerNorm) or type(owner).__name__.endswith("RMSNorm")


def _std(owner: nn.Module, leaf: str, shape: tuple[int, ...], gain: float) -> float:
    if _is_norm(owner):
        return NORM_WEIGHT_STD if leaf == "weight" else BIAS_STD
    if isinstance(owner, nn.Embedding):
        return 1.0
    if leaf in ("alpha", "beta"):
        return SNAKE_STD
    if leaf in _SCALES:
        return LAYER_SCALE_STD
    if len(shape) == 1:
        return BIAS_STD
    if isinstance(owner, nn.ConvTranspose1d):
        fan_in = shape[0] * shape[2] / owner.stride[0]  # weight [in, out, k]
    else:
        fan_in = math.prod(shape[1:])  # [out, in / groups, *kernel]
    return gain / math.sqrt(fan_in)
