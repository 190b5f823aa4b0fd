"""Hidden states of chosen layers as outputs: a request with return_hidden gets, per step,
the states of the model's hidden_layers for the tokens that step fed (the prompt's, then
each generated token's), equal to one unbatched forward over the whole sequence."""

import pytest
import torch

from omnistage.core.errors import RequestValidationError
from omnistage.engine.attention import DenseKVCache
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.engine_runs import run_arrivals
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

DTYPE = torch.float64
LAYERS = (0, 2, 1)  # the embedding output, the last layer's, the first's (any order)
THINKER = ToyTalker(ToyARConfig(num_code_groups=1, num_layers=2, hidden_layers=LAYERS), DTYPE)
GREEDY = SamplingParams(temperature=0.0)


def request(length, max_new, seed, sampling=GREEDY, hidden=True):
    g = torch.Generator().manual_seed(seed)
    return GenerationInput(torch.randint(0, 64, (length,), generator=g), sampling, max_new, return_hidden=hidden)


def engine_for(model=THINKER):
    return AREngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=128, prefill_hold_ms=0.0,
                                        max_num_seqs=4, num_step_rows=64))


def whole_sequence_states(model, inputs, tokens):
    """One dense forward over the prompt and the fed-back tokens: ``[L + T - 1, K, H]``."""
    spec = model.spec
    fed = torch.cat([model.embed_tokens(inputs.prompt), model.next_input_embeds(tokens[:-1], torch.zeros(1, 32))])
    cache = DenseKVCache(spec.num_layers, 1, fed.shape[0], spec.num_kv_heads, spec.head_dim, spec.dtype)
    cache.prepare(fed.shape[0])
    return model.forward_with_hidden(fed, torch.arange(fed.shape[0]), cache)[1]


def collect(engine, arrivals):
    run = run_arrivals(engine, arrivals)
    return run.results, run.hidden, run.frames


def test_hidden_rows_of_prompt_and_generated_tokens_equal_a_whole_sequence_forward():
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=5)
    free = reference_generate(THINKER, request(4, 12, seed=3, sampling=sampled)).codes
    stopper = request(4, 12, seed=3, sampling=SamplingParams(temperature=0.9, top_k=20, seed=5,
                                                             stop_token_ids=(int(free[5, 0]),)))
    arrivals = {0: [("long", request(6, 7, seed=1)), ("plain", request(3, 5, seed=2, hidden=False))],
                2: [("stop", stopper)]}
    engine = engine_for()
    results, hidden, frames = collect(engine, arrivals)
    assert "plain" not in hidden and len(frames["plain"]) == 5
    assert results["stop"].finish_reason == "stop" and results["long"].finish_reason == "length"
    for request_id, inputs in (("long", arrivals[0][0][1]), ("stop", stopper)):
        tokens = results[request_id].codes
        assert torch.equal(tokens, reference_generate(THINKER, inputs).codes)
        rows = hidden[request_id]
        assert rows[0].shape == (inputs.prompt.shape[0], len(LAYERS), 32)  # the prompt with frame 0
        assert all(r.shape == (1, len(LAYERS), 32) for r in rows[1:])  # then one token per step
        got = torch.cat(rows)
        # length: the last frame is never fed (no rows); stop: every emitted token has its rows
        fed = tokens.shape[0] - (1 if results[request_id].finish_reason == "length" else 0)
        assert got.shape[0] == inputs.prompt.shape[0] + fed
        expected = whole_sequence_states(THINKER, inputs, torch.cat([tokens, tokens[-1:]])[: fed + 1])
        torch.testing.assert_close(got, expected[: got.shape[0]], rtol=1e-10, atol=1e-10)
        assert torch.equal(got[: inputs.prompt.shape[0], 0], THINKER.embed_tokens(inputs.prompt))  # layer 0


def test_a_model_without_hidden_layers_refuses_return_hidden():
    plain = ToyTalker(ToyARConfig(num_code_groups=1), DTYPE)
    with pytest.raises(RequestValidationError, match="no hidden states"):
        engine_for(plain).add_request("r", request(3, 3, seed=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_return_the_same_hidden_rows_and_mrope_tokens_as_eager():
    config = ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_code_groups=1,
                         mrope=True, hidden_layers=(0, 2))
    model = ToyTalker(config, torch.bfloat16, "cuda")
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=5)

    def inputs(i):
        g = torch.Generator().manual_seed(i)
        length = 4 + i
        positions = torch.arange(length).expand(3, -1).clone()
        positions[1:, 1:3] += 2  # an "image" patch: H and W rows differ from T
        return GenerationInput(torch.randint(0, 64, (length,), generator=g), sampling, 12,
                               positions=positions, rope_delta=3, return_hidden=i % 2 == 0)

    outputs = []
    for sizes in ((), (1, 2, 4, 8)):
        engine = AREngine(model, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=8, max_model_len=256,
                                              prefill_hold_ms=0.0, cuda_graph_batch_sizes=sizes))
        outputs.append(collect(engine, {0: [(f"r{i}", inputs(i)) for i in range(6)]}))
    (eager, eager_hidden, _), (graphs, graph_hidden, _) = outputs
    assert set(eager_hidden) == set(graph_hidden) == {"r0", "r2", "r4"}
    for request_id in eager:
        assert torch.equal(eager[request_id].codes, graphs[request_id].codes), request_id
    for request_id, rows in eager_hidden.items():
        assert torch.equal(torch.cat(rows), torch.cat(graph_hidden[request_id])), request_id
