"""Our talker, prompts, generation loop and speaker encoder against the official reference.

The fixture comes from ``tools/parity/qwen3_tts_talker_reference.py`` (qwen-tts 0.1.1 on the
same tiny seed-0 checkpoints, fp32, CPU). Tolerances: float tensors within relative error
1e-4 (max abs difference / max abs reference value; both sides are fp32, the differences are
summation order); greedy codes exactly equal. The reference's talker runs its multimodal RoPE
with three equal position rows; matching logits and codes show our plain 1-D RoPE is the
same function.
"""

from __future__ import annotations

import pytest
import torch
from talker_fixtures import ReferenceFixture, weights_digest

from omnistage.models.qwen3_tts.modeling.generate import TalkerSampling, generate
from omnistage.models.qwen3_tts.modeling.prompt import PromptBuilder, TalkerPrompt
from omnistage.models.qwen3_tts.modeling.weights import LoadedCheckpoint, load_checkpoint

REL_TOL = 1e-4


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp_min(1e-12)
    err = float((actual.float() - expected.float()).abs().max() / scale)
    assert err <= REL_TOL, f"{what}: relative error {err:.2e} > {REL_TOL}"


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, reference: ReferenceFixture) -> dict[str, LoadedCheckpoint]:
    for model_type, path in tiny_checkpoints.items():
        if weights_digest(path) != reference.digests[model_type]:
            pytest.fail(
                f"the seed-0 tiny {model_type} checkpoint differs from the one the fixture was made from; "
                "regenerate it (tools/parity/qwen3_tts_talker_reference.py says how)"
            )
    return {t: load_checkpoint(p) for t, p in tiny_checkpoints.items()}


def build_prompt(ck: LoadedCheckpoint, case: dict, reference: ReferenceFixture) -> TalkerPrompt:
    builder = PromptBuilder(ck.model.talker, ck.config, ck.tokenizer)
    common = {"language": case["language"], "non_streaming_mode": case["non_streaming"]}
    if case["type"] == "custom_voice":
        return builder.custom_voice(case["text"], case["speaker"], instructions=case.get("instruct"), **common)
    if case["type"] == "voice_design":
        return builder.voice_design(case["text"], case["instruct"], **common)
    icl = {}
    if "ref_text" in case:
        icl = {"ref_text": case["ref_text"], "ref_codes": reference.tensors["icl.ref_codes"]}
    return builder.voice_clone(case["text"], reference.tensors["speaker.x_vector"], **icl, **common)


CASE_NAMES = [
    "base_xvector_streaming",
    "base_xvector_nonstreaming",
    "base_icl_streaming",
    "base_icl_streaming_long_text",
    "base_icl_nonstreaming",
    "custom_voice_nonstreaming",
    "custom_voice_dialect_streaming",
    "custom_voice_instruct",
    "voice_design_nonstreaming",
    "voice_design_streaming",
]


def test_fixture_covers_every_case(reference: ReferenceFixture) -> None:
    assert sorted(reference.cases) == sorted(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_prompt_matches_reference(name: str, checkpoints, reference: ReferenceFixture) -> None:
    """Prefill rows, trailing text rows and the tts_pad row equal the reference's within 1e-4."""
    case = reference.cases[name]
    prompt = build_prompt(checkpoints[case["type"]], case, reference)
    assert_rel_close(prompt.prefill, reference.tensors[f"{name}.prefill"], "prefill")
    assert_rel_close(prompt.step_rows, reference.tensors[f"{name}.trailing"], "trailing text")
    assert_rel_close(prompt.tts_pad, reference.tensors[f"{name}.tts_pad"], "tts_pad")


@pytest.mark.parametrize("name", ["base_icl_streaming", "custom_voice_instruct", "voice_design_streaming"])
def test_prefill_logits_match_reference(name: str, checkpoints, reference: ReferenceFixture) -> None:
    """Code-0 logits after the reference's own prefill embeddings agree within 1e-4."""
    talker = checkpoints[reference.cases[name]["type"]].model.talker
    prefill = reference.tensors[f"{name}.prefill"]
    cache = talker.model.new_dense_cache(1, prefill.shape[0], prefill.dtype, "cpu")
    cache.prepare(prefill.shape[0])
    with torch.no_grad():
        hidden = talker(prefill, torch.arange(prefill.shape[0]), cache)
        logits = talker.codec_logits(hidden[-1:])[0]
    assert_rel_close(logits, reference.tensors[f"{name}.logits"], "logits")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_greedy_codes_match_reference(name: str, checkpoints, reference: ReferenceFixture) -> None:
    """Greedy talker + predictor (repetition penalty 1.05) reproduce the reference's frames."""
    case = reference.cases[name]
    ck = checkpoints[case["type"]]
    prompt = build_prompt(ck, case, reference)
    result = generate(ck.model.talker, prompt, TalkerSampling.greedy(), max_new_frames=reference.frames)
    expected = reference.tensors[f"{name}.codes"]
    assert result.codes.shape[0] >= 20
    torch.testing.assert_close(result.codes, expected, rtol=0, atol=0)


def test_speaker_encoder_matches_reference(checkpoints, reference: ReferenceFixture) -> None:
    """Mel front end + ECAPA-TDNN x-vector of the stored clip within 1e-4."""
    encoder = checkpoints["base"].model.speaker_encoder
    with torch.no_grad():
        x_vector = encoder.embed(reference.tensors["clip"])
    assert_rel_close(x_vector, reference.tensors["speaker.x_vector"], "x-vector")
