"""The thinker and talker served by the AR engine (batched, paged KV, 3-D MRoPE positions
with fractional video T, the vision encoder's deepstack features as the requests' hidden
additions, hidden states of chosen layers) reproduce transformers: the fixture's text,
image, audio, video, mixed and audio-in-video prompts run together as one batch; greedy
tokens exact, logits (from the final-norm state the engine returns) within 1e-4, and the
talker's greedy codes from the engine's thinker rows exact."""

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


def test_engine_thinker_then_talker_match_reference(
    model, omni_reference: ReferenceFixture
) -> None:
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
    talker_requests = {}
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
            prompt = build_talker_prompt(model.talker, model.thinker.model.embed_tokens, cfg, rows, ref.meta["speaker"],
                                         layouts[name])  # fmt: skip
        talker_requests[name] = GenerationInput(
            prompt.prefill, talker_sampling(model.talker), ref.meta["talker_frames"], step_rows=prompt.step_rows,
            pad_embed=prompt.tts_pad, positions=prompt.positions.positions, rope_delta=prompt.positions.delta,
        )  # fmt: skip
    with torch.no_grad():
        talker_results, _ = run(
            AREngine(TalkerEngineModel(model.talker), config()), talker_requests
        )
    for name in CASES:
        torch.testing.assert_close(
            talker_results[name].codes, ref.case(name, "codes"), rtol=0, atol=0
        )
