"""The AR engine serving the Qwen3-TTS talker (batched, paged KV, requests joining and
leaving) produces exactly the frames of the one reference loop, ``modeling/generate.py``,
for greedy AND seeded sampling."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.models.qwen3_tts.capabilities import Qwen3TTSModelFacts
from omnistage.models.qwen3_tts.engine_model import Qwen3TTSEngineModel
from omnistage.models.qwen3_tts.modeling.generate import TalkerSampling, generate, generation_input
from omnistage.models.qwen3_tts.modeling.prompt import PromptBuilder
from omnistage.models.qwen3_tts.modeling.weights import LoadedCheckpoint, load_checkpoint
from omnistage.testing.engine_runs import run_arrivals

TEXTS = ("Hello there.", "A longer sentence for the talker.", "Hi.", "Good day to you all.")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> LoadedCheckpoint:
    return load_checkpoint(tiny_checkpoints["custom_voice"])


def _run(engine: AREngine, arrivals: dict[int, list]) -> dict:
    return run_arrivals(engine, arrivals).results


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_engine_equals_the_reference_loop(checkpoint: LoadedCheckpoint, seeded: bool):
    talker = checkpoint.model.talker
    builder = PromptBuilder(talker, checkpoint.config, checkpoint.tokenizer)
    voice = Qwen3TTSModelFacts.from_config(checkpoint.config).voices[0]
    cases = {}
    for i, text in enumerate(TEXTS):
        sampling = (
            TalkerSampling.from_generation_config(checkpoint.generation, seed=100 + i)
            if seeded
            else TalkerSampling.greedy()
        )
        prompt = builder.custom_voice(text, voice, non_streaming_mode=i % 2 == 0)
        cases[f"r{i}"] = (prompt, sampling, 5 + 2 * i)
    if seeded:
        assert all(c[1].temperature > 0 and c[1].sub_temperature > 0 for c in cases.values())
    engine = AREngine(
        Qwen3TTSEngineModel(talker),
        EngineConfig(kv_cache_bytes=8 << 20, max_num_seqs=3, max_model_len=512, prefill_hold_ms=0.0),
    )
    inputs = {rid: generation_input(talker, p, s, n) for rid, (p, s, n) in cases.items()}
    results = _run(engine, {0: [(r, inputs[r]) for r in ("r0", "r1", "r2")], 3: [("r3", inputs["r3"])]})
    assert results.keys() == cases.keys()
    for request_id, (prompt, sampling, frames) in cases.items():
        expected = generate(talker, prompt, sampling, frames)
        got = results[request_id]
        assert got.finish_reason == expected.finish_reason, request_id
        assert torch.equal(got.codes.cpu(), expected.codes.cpu()), request_id
        if seeded:  # the predictor really drew: not all greedy codes
            assert expected.codes.shape[0] == 0 or len(set(expected.codes[:, 1:].flatten().tolist())) > 1
