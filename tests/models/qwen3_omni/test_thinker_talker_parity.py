"""Our thinker, MRoPE positions, talker prompt and talker against transformers 5.24.

The fixture comes from ``tools/parity/qwen3_omni_reference.py`` (transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` on the same tiny seed-0 checkpoint, fp32,
CPU), for a text prompt and image, audio, video, mixed and audio-in-video prompts; the encoder
rows transformers' encoders produced are fed to our thinker. Tolerances: positions exact,
greedy thinker tokens and talker codes exact, float tensors within relative error 1e-4
(max abs difference / max abs reference value).
"""

from __future__ import annotations

import pytest
import torch
from omni_fixtures import (
    CASES,
    REL_TOL,
    ReferenceFixture,
    encoder_rows,
    layout_of,
    rel_err,
    weights_digest,
)

from omnistage.models.qwen3_omni.modeling.generate import talker_generate, thinker_generate
from omnistage.models.qwen3_omni.modeling.model import LoadedOmni, load_model
from omnistage.models.qwen3_omni.modeling.mrope import prompt_positions
from omnistage.models.qwen3_omni.modeling.prompt import ThinkerRows, build_talker_prompt
from omnistage.models.qwen3_omni.modeling.thinker import EncoderRows


@pytest.fixture(scope="module")
def model(omni_tiny_checkpoint, omni_reference: ReferenceFixture) -> LoadedOmni:
    if weights_digest(omni_tiny_checkpoint) != omni_reference.meta["digest"]:
        pytest.fail(
            "the seed-0 tiny checkpoint differs from the fixture's; regenerate (tools/parity/qwen3_omni_reference.py)"
        )
    return load_model(omni_tiny_checkpoint)


_RUNS: dict[str, tuple] = {}  # case -> (ids, ThinkerResult): the thinker runs once per case


def run_thinker(model: LoadedOmni, ref: ReferenceFixture, name: str):
    if name in _RUNS:
        return _RUNS[name]
    ids = ref.case(name, "ids")
    positions = prompt_positions(ids.tolist(), model.config.thinker, layout_of(ref, name))
    embeds, deepstack = model.thinker.merge(ids, encoder_rows(ref, name))
    result = thinker_generate(
        model.thinker, ids, positions, ref.meta["thinker_tokens"], model.config.im_end_id,
        input_embeds=embeds, deepstack=deepstack, capture_layer=model.config.talker.accept_hidden_layer,
    )  # fmt: skip
    _RUNS[name] = (ids, result)
    return ids, result


def test_fixture_covers_every_case(omni_reference: ReferenceFixture) -> None:
    assert sorted(omni_reference.meta["cases"]) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_positions_match_reference(
    name: str, model: LoadedOmni, omni_reference: ReferenceFixture
) -> None:
    """3-D MRoPE positions and the decode delta equal transformers' get_rope_index exactly
    (fractional video T included)."""
    ids = omni_reference.case(name, "ids")
    positions = prompt_positions(
        ids.tolist(), model.config.thinker, layout_of(omni_reference, name)
    )
    torch.testing.assert_close(
        positions.positions, omni_reference.case(name, "positions"), rtol=0, atol=0
    )
    assert positions.delta == float(omni_reference.case(name, "delta"))


@pytest.mark.parametrize("name", CASES)
def test_thinker_greedy_matches_reference(
    name: str, model: LoadedOmni, omni_reference: ReferenceFixture
) -> None:
    """Greedy tokens exactly; logits at the stored vocabulary ids and at each step's argmax
    within 1e-4."""
    _, result = run_thinker(model, omni_reference, name)
    torch.testing.assert_close(result.tokens, omni_reference.case(name, "tokens"), rtol=0, atol=0)
    ids = omni_reference.tensors["logit_ids"]
    assert rel_err(result.logits[:, ids], omni_reference.case(name, "logits")) <= REL_TOL
    steps = torch.arange(result.logits.shape[0])
    chosen = result.logits[steps, result.tokens]
    assert rel_err(chosen, omni_reference.case(name, "argmax_logits")) <= REL_TOL


@pytest.mark.parametrize("name", CASES)
def test_talker_matches_reference(
    name: str, model: LoadedOmni, omni_reference: ReferenceFixture
) -> None:
    """From our thinker's output: the talker prefill (layer-accept_hidden_layer rows at the
    multimodal positions) and trailing text rows within 1e-4, first code-0 logits within 1e-4,
    greedy codes exactly."""
    ref = omni_reference
    ids, result = run_thinker(model, ref, name)
    rows = ThinkerRows(
        prompt_ids=ids, reply_ids=result.tokens, embeds=result.embeds, hidden=result.captured
    )
    prompt = build_talker_prompt(model.talker, model.thinker.model.embed_tokens, model.config, rows, ref.meta["speaker"],
                                 layout_of(ref, name))  # fmt: skip
    assert rel_err(prompt.prefill, ref.case(name, "talker_prefill")) <= REL_TOL
    assert rel_err(prompt.step_rows, ref.case(name, "talker_trailing")) <= REL_TOL
    talker = talker_generate(model.talker, prompt, ref.meta["talker_frames"])
    assert rel_err(talker.first_logits, ref.case(name, "talker_first_logits")) <= REL_TOL
    torch.testing.assert_close(talker.codes, ref.case(name, "codes"), rtol=0, atol=0)


@pytest.fixture(scope="module")
def encoders(omni_tiny_checkpoint) -> LoadedOmni:
    return load_model(omni_tiny_checkpoint, parts=("audio_tower", "visual"))


def encode(encoders: LoadedOmni, ref: ReferenceFixture, name: str) -> EncoderRows:
    """Our audio and vision encoders on the raw inputs transformers was given."""
    used, t = ref.meta["cases"][name]["encoders"], ref.tensors
    rows: dict = {}
    with torch.no_grad():
        if "audio" in used:
            mel = t["input.input_features"][0]
            rows["audio"] = encoders.audio_tower(mel, torch.tensor([mel.shape[1]])).embeddings
        for kind, pixels, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            if kind in used:
                out = encoders.visual(t[f"input.{pixels}"], t[f"input.{grid}"])
                rows[kind], rows[f"{kind}_deepstack"] = out.embeddings, tuple(out.deepstack)
    return EncoderRows(**rows)


@pytest.mark.parametrize("name", [n for n in CASES if n != "text"])
def test_raw_inputs_through_our_encoders_match_reference(
    name: str, model: LoadedOmni, encoders: LoadedOmni, omni_reference: ReferenceFixture
) -> None:
    """End to end from the raw mel / pixel inputs: our encoders' rows (deepstack included)
    within 1e-4 of transformers', and our thinker's greedy tokens on them exact."""
    ref = omni_reference
    rows = encode(encoders, ref, name)
    expected = encoder_rows(ref, name)
    for field in ("audio", "image", "video"):
        if getattr(expected, field) is not None:
            assert rel_err(getattr(rows, field), getattr(expected, field)) <= REL_TOL, field
    for field in ("image_deepstack", "video_deepstack"):
        for ours, theirs in zip(getattr(rows, field), getattr(expected, field), strict=True):
            assert rel_err(ours, theirs) <= REL_TOL, field
    ids = ref.case(name, "ids")
    embeds, deepstack = model.thinker.merge(ids, rows)
    positions = prompt_positions(ids.tolist(), model.config.thinker, layout_of(ref, name))
    result = thinker_generate(model.thinker, ids, positions, ref.meta["thinker_tokens"], model.config.im_end_id,
                              input_embeds=embeds, deepstack=deepstack)  # fmt: skip
    torch.testing.assert_close(result.tokens, ref.case(name, "tokens"), rtol=0, atol=0)
