"""Loading the parity fixtures of tools/parity/qwen3_omni_encoders_reference.py and the
seeded module they were made with."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from omnistage.models.qwen3_omni.modeling.random_init import random_state_dict

FIXTURES = Path(__file__).parent / "fixtures"


def load_fixture(name: str) -> dict[str, np.ndarray]:
    """The arrays of ``fixtures/<name>``."""
    with np.load(FIXTURES / name) as data:
        return {k: data[k] for k in data.files}


def seeded_module(
    reference: dict[str, np.ndarray],
    build: Callable[[dict], nn.Module],
    gains: dict[str, float] | None = None,
) -> nn.Module:
    """``build(sub-config dict)`` with the fixture's random weights (seed 0, ``gains`` as
    the parity script), in eval mode; fails if they are not the fixture's weights."""
    module = build(json.loads(str(reference["config"])))
    state = random_state_dict(module, 0, gains)
    fingerprint = sum(float(t.double().abs().sum()) for t in state.values())
    assert fingerprint == pytest.approx(float(reference["weights_fingerprint"]), rel=1e-12)
    module.load_state_dict(state, strict=True)
    return module.eval()


def check_inputs(reference: dict[str, np.ndarray], inputs: torch.Tensor) -> None:
    """Fails if the seeded inputs differ from those the fixture was made with."""
    fingerprint = float(inputs.double().abs().sum())
    assert fingerprint == pytest.approx(float(reference["inputs_fingerprint"]), rel=1e-12)


def rel_error(ours: torch.Tensor, theirs: np.ndarray | torch.Tensor) -> float:
    """Max absolute difference relative to the reference's peak."""
    theirs = torch.as_tensor(theirs)
    assert ours.shape == theirs.shape
    return float((ours - theirs).abs().max() / theirs.abs().max())
