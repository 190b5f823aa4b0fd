"""The served benchmark's transformers reference (``benchmarks/qwen3_omni_served.py``) runs on
the weights the server draws: its thinker text model and talker equal what transformers loads
from the ``init-random`` checkpoint of the same seed (which equals a dummy load)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen3OmniMoeForConditionalGeneration

from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint

ROOT = Path(__file__).resolve().parents[3]


def load_benchmark(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling modules, as when run as a script
    path = ROOT / "benchmarks/qwen3_omni_served.py"
    spec = importlib.util.spec_from_file_location("qwen3_omni_served", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@torch.inference_mode()
def test_reference_gets_the_served_thinker_and_talker_weights(tmp_path, monkeypatch):
    benchmark = load_benchmark(monkeypatch)
    root = write_random_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    raw = json.loads((root / "config.json").read_text())
    loaded = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(root), dtype=torch.float32)
    ref = Qwen3OmniMoeForConditionalGeneration._from_config(
        AutoConfig.from_pretrained(str(root)), dtype=torch.float32
    )
    filled = benchmark.fill_with_served_weights(ref, raw, torch.device("cpu"))
    want, got = dict(loaded.named_parameters()), dict(ref.named_parameters())
    equal = {name for name in want if torch.equal(want[name], got[name])}
    language = {
        name
        for name in want
        if name.startswith(("thinker.model.language_model.", "thinker.lm_head.", "talker."))
    }
    assert filled == len(language) > 100
    assert language <= equal  # stacked experts included
    # the encoders and code2wav keep transformers' own init
    assert not any(name.startswith("code2wav.") for name in equal)
