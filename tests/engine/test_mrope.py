"""3-D multimodal RoPE positions: a prompt's [3, L] positions come from its request, a
decode step's position is the cache length + the request's rope_delta on all three rows;
1-D models keep their positions as they were."""

import pytest
import torch

from omnistage.core.errors import RequestValidationError
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.engine_runs import run_arrivals
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

DTYPE = torch.float64
MROPE = ToyTalker(ToyARConfig(num_code_groups=1, mrope=True, head_dim=12), DTYPE)
GREEDY = SamplingParams(temperature=0.0)


def image_positions(text_before: int, grid: tuple[int, int], text_after: int) -> tuple[torch.Tensor, int]:
    """Qwen-style positions of text, an image of ``grid`` (T constant, H/W its row and
    column), then text; and the rope_delta (max + 1 - L)."""
    h, w = grid
    t0 = torch.arange(text_before).expand(3, -1)
    image = torch.stack([torch.full((h * w,), text_before),
                         text_before + torch.arange(h).repeat_interleave(w),
                         text_before + torch.arange(w).repeat(h)])
    start = int(image.max()) + 1
    after = (start + torch.arange(text_after)).expand(3, -1)
    positions = torch.cat([t0, image, after], dim=1)
    return positions, int(positions.max()) + 1 - positions.shape[1]


def request(positions, delta, seed, max_new=8, sampling=GREEDY):
    g = torch.Generator().manual_seed(seed)
    length = positions.shape[1] if positions is not None else 5
    prompt = torch.randint(0, 64, (length,), generator=g)
    return GenerationInput(prompt, sampling, max_new, positions=positions, rope_delta=delta)


def engine_for(model=MROPE):
    return AREngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=128, prefill_hold_ms=0.0,
                                        max_num_seqs=4, num_step_rows=64))


def run(engine, arrivals):
    return run_arrivals(engine, arrivals).results


def test_mrope_requests_batched_equal_the_reference_loop():
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=3)
    pos_a, delta_a = image_positions(2, (3, 4), 3)
    pos_b, delta_b = image_positions(4, (2, 2), 1)
    arrivals = {
        0: [("a", request(pos_a, delta_a, 1)), ("text", request(None, 0, 2, max_new=10))],
        2: [("b", request(pos_b, delta_b, 3, sampling=sampled))],
        3: [("c", request(pos_a, delta_a, 4, max_new=5))],
    }
    assert delta_a < 0 and delta_b < 0
    engine = engine_for()
    results = run(engine, arrivals)
    for inputs_list in arrivals.values():
        for request_id, inputs in inputs_list:
            codes = reference_generate(MROPE, inputs).codes
            assert torch.equal(results[request_id].codes, codes), request_id
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks


def test_the_positions_and_the_delta_both_change_the_output():
    positions, delta = image_positions(2, (3, 4), 3)
    base = request(positions, delta, 5, max_new=12)
    flat = GenerationInput(base.prompt, GREEDY, 12)  # the same tokens at 0..L-1
    shifted = GenerationInput(base.prompt, GREEDY, 12, positions=positions, rope_delta=delta + 7)
    results = run(engine_for(), {0: [("base", base), ("flat", flat), ("shifted", shifted)]})
    assert not torch.equal(results["base"].codes, results["flat"].codes)
    assert torch.equal(results["base"].codes[0], results["shifted"].codes[0])  # same prefill
    assert not torch.equal(results["base"].codes, results["shifted"].codes)  # decode positions differ


def test_bad_positions_are_refused():
    with pytest.raises(RequestValidationError, match=r"positions must be \[3, 5\] int64 or float32"):
        GenerationInput(torch.zeros(5, dtype=torch.int64), GREEDY, 4, positions=torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(RequestValidationError, match="positions must be"):
        GenerationInput(torch.zeros(5, dtype=torch.int64), GREEDY, 4, positions=torch.zeros(3, 5, dtype=torch.float64))
    one_d = ToyTalker(ToyARConfig(num_code_groups=1), DTYPE)
    with pytest.raises(RequestValidationError, match="1-D positions"):
        engine_for(one_d).add_request("r", request(image_positions(1, (2, 2), 1)[0], 0, 6))
    with pytest.raises(RequestValidationError, match="1-D positions"):
        engine_for(one_d).add_request("r", request(None, 3, 6))
