"""Hidden additions: rows a request adds to the backbone's hidden states at chosen prompt
positions after its first layers (DeepStack), during its prefill, and fractional 3-D
positions. Batched prefills (requests with and without additions, different layer counts)
equal the unbatched reference loop; the additions and the fractional part of the positions
reach the model; bad additions are refused before any work."""

import pytest
import torch

from omnistage.core.errors import RequestValidationError
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput, HiddenAdditions
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

DTYPE = torch.float64
MODEL = ToyTalker(ToyARConfig(num_code_groups=1, mrope=True, head_dim=12, hidden_addition_layers=2,
                              hidden_layers=(0, 1)), DTYPE)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0)


def additions(rows: list[int], layers: int, seed: int) -> HiddenAdditions:
    g = torch.Generator().manual_seed(seed)
    embeds = tuple(torch.randn(len(rows), 32, generator=g, dtype=DTYPE) * 3 for _ in range(layers))
    return HiddenAdditions(torch.tensor(rows), embeds)


def request(length: int, seed: int, add: HiddenAdditions | None = None, fraction: float = 0.0,
            max_new: int = 8, sampling: SamplingParams = GREEDY) -> GenerationInput:
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(length, dtype=torch.float32).expand(3, -1).clone()
    positions[0, 1:] += fraction  # a fractional T row, as a video's
    return GenerationInput(torch.randint(0, 64, (length,), generator=g), sampling, max_new,
                           positions=positions, rope_delta=fraction, hidden_additions=add,
                           return_hidden=True)  # fmt: skip


def engine() -> AREngine:
    return AREngine(MODEL, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=128, prefill_hold_ms=0.0,
                                        max_num_seqs=4, num_step_rows=64))  # fmt: skip


def run(eng: AREngine, requests: dict[str, GenerationInput]) -> tuple[dict, dict]:
    for request_id, inputs in requests.items():
        eng.add_request(request_id, inputs)
    results, hidden = {}, {}
    while eng.has_work():
        for out in eng.step():
            if out.hidden is not None:
                hidden.setdefault(out.request_id, []).append(out.hidden)
            if out.result is not None:
                results[out.request_id] = out.result
    return results, {k: torch.cat(v) for k, v in hidden.items()}


def test_a_batched_prefill_adds_each_request_s_rows_as_the_reference_loop() -> None:
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=5)
    requests = {
        "two_layers": request(7, 1, additions([1, 2, 5], 2, 10), fraction=0.5),
        "plain": request(5, 2),
        "one_layer": request(6, 3, additions([0, 4], 1, 11), fraction=0.25, sampling=sampled),
    }
    eng = engine()
    results, hidden = run(eng, requests)
    for request_id, inputs in requests.items():
        assert torch.equal(results[request_id].codes, reference_generate(MODEL, inputs).codes), request_id
    # the state after the first layer is captured before that layer's additions: over the
    # prompt it equals the same request's without additions
    alone = run(engine(), {"a": requests["two_layers"]})[1]["a"]
    base = run(engine(), {"a": request(7, 1, None, fraction=0.5)})[1]["a"]
    torch.testing.assert_close(alone[:7, 1], base[:7, 1])
    torch.testing.assert_close(alone, hidden["two_layers"])
    assert eng.kv_blocks.num_free_blocks == eng.kv_blocks.num_blocks


def test_the_additions_and_the_fractional_positions_reach_the_model() -> None:
    base = request(7, 1, additions([1, 2, 5], 2, 10), fraction=0.5, max_new=12)
    variants = {
        "no additions": request(7, 1, None, fraction=0.5, max_new=12),
        "other rows": request(7, 1, additions([0, 3, 6], 2, 10), fraction=0.5, max_new=12),
        "integer positions": request(7, 1, additions([1, 2, 5], 2, 10), fraction=0.0, max_new=12),
    }
    results, hidden = run(engine(), {"base": base, **variants})
    for name in variants:
        assert not torch.equal(hidden[name], hidden["base"]), name


def test_bad_additions_are_refused() -> None:
    prompt = torch.zeros(5, dtype=torch.int64)
    for rows, match in (([5], "prompt positions"), ([1, 1], "distinct"), ([-1], "prompt positions")):
        with pytest.raises(RequestValidationError, match=match):
            GenerationInput(prompt, GREEDY, 4, hidden_additions=additions(rows, 1, 0))
    with pytest.raises(RequestValidationError, match=r"\[2, H\]"):
        GenerationInput(prompt, GREEDY, 4, hidden_additions=HiddenAdditions(torch.tensor([0, 1]),
                                                                            (torch.zeros(3, 32),)))  # fmt: skip
    with pytest.raises(RequestValidationError, match="at 2 at most"):
        engine().add_request("r", request(5, 0, additions([1], 3, 0)))
    plain = ToyTalker(ToyARConfig(num_code_groups=1, mrope=True, head_dim=12), DTYPE)
    eng = AREngine(plain, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=128, prefill_hold_ms=0.0,
                                       max_num_seqs=4, num_step_rows=64))  # fmt: skip
    with pytest.raises(RequestValidationError, match="at 0 at most"):
        eng.add_request("r", GenerationInput(prompt, GREEDY, 4, hidden_additions=additions([1], 1, 0)))
