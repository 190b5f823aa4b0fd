"""The thinker and talker served by the AR engine (batched, paged KV, 3-D MRoPE positions
with fractional video T, the vision encoder's deepstack features as the requests' hidden
additions, hidden states of chosen layers) reproduce transformers: the fixture's text,
image, audio, video, mixed and audio-in-video prompts run together as one batch; greedy
tokens exact, logits (from the final-norm state the engine returns) within 1e-4, and the
talker's greedy codes from the engine's thinker rows exact; a talker request whose next text
row has not arrived waits without holding back another."""

from __future__ import annotations

import pytest
import torch
from omni_fixtures import CASES, REL_TOL, ReferenceFixture, encoder_rows, layout_of, rel_err

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel, ThinkerEngineModel
from omnistage.models.qwen3_omni.modeling.generate import talker_sampling
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.modeling.mrope import prompt_positions
from omnistage.models.qwen3_omni.modeling.prompt import ThinkerRows, build_talker_prompt


def run(engine: AREngine, requests: dict[str, GenerationInput]) -> tuple[dict, dict]:
    for request_id, inputs in requests.items():
        engine.add_request(request_id, inputs)
    results, hidden = {}, {}
    while engine.has_work():
        for out in engine.step():
            if out.hidden is not None:
                hidden.setdefault(out.request_id, []).append(out.hidden)
            if out.result is not None:
                results[out.request_id] = out.result
    return results, {k: torch.cat(v) for k, v in hidden.items()}


def config() -> EngineConfig:
    return EngineConfig(
        kv_cache_bytes=16 << 20,
        max_model_len=256,
        prefill_hold_ms=0.0,
        max_num_seqs=len(CASES),
        num_step_rows=64,
    )


@pytest.fixture(scope="module")
def model(omni_tiny_checkpoint):
    return load_model(omni_tiny_checkpoint)


@pytest.fixture(scope="module")
def talker_prompts(model, omni_reference: ReferenceFixture) -> dict:
    """Every case through the engine's thinker (checked against transformers' tokens and
    logits), then its talker prompt from the rows the engine returned."""
    ref, cfg = omni_reference, model.config
    accept, last = cfg.talker.accept_hidden_layer, cfg.thinker.text.num_layers
    thinker = ThinkerEngineModel(model.thinker, hidden_layers=(0, accept, last))
    requests, layouts = {}, {}
    for name in CASES:
        ids = ref.case(name, "ids")
        embeds, deepstack = model.thinker.merge(ids, encoder_rows(ref, name))
        assert (deepstack is not None) == (name not in ("text", "audio")), name
        layouts[name] = layout_of(ref, name)
        positions = prompt_positions(ids.tolist(), cfg.thinker, layouts[name])
        requests[name] = GenerationInput(
            embeds, SamplingParams(temperature=0.0, stop_token_ids=(cfg.im_end_id,)), ref.meta["thinker_tokens"],
            positions=positions.positions, rope_delta=positions.delta, return_hidden=True, hidden_additions=deepstack,
        )  # fmt: skip
    with torch.no_grad():
        results, hidden = run(AREngine(thinker, config()), requests)
    prompts = {}
    logit_ids = ref.tensors["logit_ids"]
    for name in CASES:
        tokens = results[name].codes[:, 0]
        torch.testing.assert_close(tokens, ref.case(name, "tokens"), rtol=0, atol=0)
        length = ref.case(name, "ids").shape[0]
        # the logits of each generated token: from the prompt's last row and each fed token
        with torch.no_grad():
            logits = model.thinker.logits(hidden[name][length - 1 :, 2])[: tokens.shape[0]]
        assert rel_err(logits[:, logit_ids], ref.case(name, "logits")) <= REL_TOL, name
        chosen = logits[torch.arange(tokens.shape[0]), tokens]
        assert rel_err(chosen, ref.case(name, "argmax_logits")) <= REL_TOL, name
        rows = ThinkerRows(
            prompt_ids=ref.case(name, "ids"),
            reply_ids=tokens,
            embeds=hidden[name][:, 0],
            hidden=hidden[name][:, 1],
        )
        with torch.no_grad():
            prompts[name] = build_talker_prompt(model.talker, model.thinker.model.embed_tokens, cfg, rows,
                                                ref.meta["speaker"], layouts[name])  # fmt: skip
    return prompts


def talker_request(model, prompt, frames: int, given: int | None = None) -> GenerationInput:
    """The talker's request; ``given``: only that many trailing text rows now, the rest
    streamed in later (``more_rows``)."""
    rows = prompt.step_rows if given is None else prompt.step_rows[:given]
    return GenerationInput(
        prompt.prefill, talker_sampling(model.talker), frames, step_rows=rows, pad_embed=prompt.tts_pad,
        positions=prompt.positions.positions, rope_delta=prompt.positions.delta, more_rows=given is not None,
    )  # fmt: skip


def test_engine_thinker_then_talker_match_reference(
    model, talker_prompts, omni_reference: ReferenceFixture
) -> None:
    ref = omni_reference
    requests = {name: talker_request(model, talker_prompts[name], ref.meta["talker_frames"]) for name in CASES}
    with torch.no_grad():
        talker_results, _ = run(AREngine(TalkerEngineModel(model.talker), config()), requests)
    for name in CASES:
        torch.testing.assert_close(
            talker_results[name].codes, ref.case(name, "codes"), rtol=0, atol=0
        )


def test_a_talker_request_waiting_for_its_text_rows_holds_back_no_other(
    model, talker_prompts, omni_reference: ReferenceFixture
) -> None:
    """The video case's talker gets one trailing text row, the rest later: it waits at its
    second fed frame, unpadded, while the image case (all rows given) runs to its end in the
    same engine; given the rest, it finishes with transformers' codes, as does the other."""
    ref, frames = omni_reference, omni_reference.meta["talker_frames"]
    slow = talker_prompts["video"]
    assert slow.step_rows.shape[0] > 1
    engine = AREngine(TalkerEngineModel(model.talker), config())
    engine.add_request("slow", talker_request(model, slow, frames, given=1))
    engine.add_request("other", talker_request(model, talker_prompts["image"], frames))
    codes: dict[str, list[torch.Tensor]] = {"slow": [], "other": []}
    done = {}
    with torch.no_grad():
        for _ in range(4 * frames):  # bounded: each step makes a frame of a runnable request
            for out in engine.step():
                if out.frame is not None:
                    codes[out.request_id].append(out.frame)
                if out.result is not None:
                    done[out.request_id] = out.result
            if "other" in done:
                break
        assert "other" in done and "slow" not in done
        waiting = engine.scheduler.get("slow")
        # frame 0 (prefill), frame 1 (fed row 0); frame 2 needs row 1
        assert len(codes["slow"]) == 2 and not waiting.schedulable
        engine.append_step_rows("slow", slow.step_rows[1:])
        engine.complete_step_rows("slow")
        while engine.has_work():
            for out in engine.step():
                if out.frame is not None:
                    codes[out.request_id].append(out.frame)
                if out.result is not None:
                    done[out.request_id] = out.result
    torch.testing.assert_close(done["other"].codes, ref.case("image", "codes"), rtol=0, atol=0)
    torch.testing.assert_close(done["slow"].codes, ref.case("video", "codes"), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(codes["slow"]), ref.case("video", "codes"), rtol=0, atol=0)
