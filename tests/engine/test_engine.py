"""The AR engine on the toy talker: equal to the unbatched reference loop under continuous
batching, stopping rules, admission, aborts and failures, and no KV block left behind."""

import pytest
import torch

from omnistage.core.errors import QueueFullError, RequestValidationError
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.engine_runs import run_arrivals
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

DTYPE = torch.float64  # batched and unbatched matmuls then agree far below any logit gap
GREEDY = SamplingParams(temperature=0.0)
MULTI = ToyTalker(ToyARConfig(), DTYPE)
TOKEN_LM = ToyTalker(ToyARConfig(num_code_groups=1), DTYPE)


def request(length, max_new, sampling=GREEDY, rows=2, seed=0, token_ids=False, predictor=None, hidden=32):
    g = torch.Generator().manual_seed(seed)
    if token_ids:
        prompt = torch.randint(0, 64, (length,), generator=g)
    else:
        prompt = torch.randn(length, hidden, generator=g, dtype=DTYPE)
    return GenerationInput(
        prompt, sampling, max_new,
        step_rows=torch.randn(rows, hidden, generator=g, dtype=DTYPE) if rows else None,
        pad_embed=torch.randn(hidden, generator=g, dtype=DTYPE),
        predictor_sampling=predictor,
    )


def engine_for(model=MULTI, **overrides):
    config = dict(kv_cache_bytes=1 << 20, max_model_len=128, prefill_hold_ms=0.0, max_num_seqs=4, num_step_rows=256)
    return AREngine(model, EngineConfig(**(config | overrides)))


def run(engine, arrivals, streamed=None):
    """Step until idle; ``arrivals[step]`` = requests added before that step. Returns
    {id: result}; asserts streamed frames (``streamed``: those of earlier steps)
    concatenate to each result."""
    steps = run_arrivals(engine, arrivals)
    streamed = streamed or {}
    for request_id, frames in steps.frames.items():
        streamed.setdefault(request_id, []).extend(frames)
    for request_id, result in steps.results.items():
        frames = streamed.get(request_id, [])
        assert torch.equal(torch.cat(frames) if frames else result.codes, result.codes)
    return steps.results


def assert_nothing_held(engine):
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
    assert engine.row_blocks.num_free_blocks == engine.row_blocks.num_blocks
    assert not engine.live_requests() and not engine.has_work()


def test_steps_record_no_autograd_graph_even_for_trainable_weights():
    """A model whose weights require grad (as ``nn.Module`` makes them) must not leave
    autograd history in the engine's persistent buffers: it would chain every step's graph
    and hold all activations alive."""
    model = ToyTalker(ToyARConfig(), DTYPE).requires_grad_(True)
    engine = engine_for(model)
    run(engine, {0: [("a", request(5, 4)), ("b", request(3, 6, seed=1))]})
    for buffer in (engine.runner.last_codes, engine.runner.step_rows):
        assert not buffer.requires_grad and buffer.grad_fn is None
    assert_nothing_held(engine)


@pytest.mark.parametrize("model", [MULTI, TOKEN_LM], ids=["16-codebook-like", "token-lm"])
def test_greedy_output_equals_the_reference_loop_with_requests_joining_and_leaving(model):
    arrivals = {
        0: [("a", request(3, 9, seed=1)), ("b", request(7, 4, seed=2, token_ids=True))],
        2: [("c", request(1, 12, seed=3, rows=0))],
        3: [("d", request(5, 2, seed=4, rows=5)), ("e", request(2, 6, seed=5))],  # d waits for a slot
        9: [("f", request(4, 5, seed=6, token_ids=True))],
    }
    engine = engine_for(model)
    results = run(engine, arrivals)
    for inputs_list in arrivals.values():
        for request_id, inputs in inputs_list:
            expected = reference_generate(model, inputs)
            codes, reason = expected.codes, expected.finish_reason
            assert results[request_id].finish_reason == reason == "length"
            assert torch.equal(results[request_id].codes, codes), request_id
            assert results[request_id].codes.shape == (inputs.max_new_tokens, model.spec.num_code_groups)
    assert_nothing_held(engine)


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch():
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=77)
    mine = request(4, 10, sampling, seed=9, predictor=SamplingParams(temperature=0.9, top_k=5, seed=78))
    alone = run(engine_for(), {0: [("me", mine)]})["me"]
    others = [(f"o{i}", request(3 + i, 8, SamplingParams(temperature=0.8, seed=i), seed=20 + i)) for i in range(3)]
    batched = run(engine_for(), {0: others[:2] + [("me", mine)], 3: others[2:]})["me"]
    assert torch.equal(alone.codes, batched.codes)
    assert torch.equal(alone.codes, reference_generate(MULTI, mine).codes)
    assert len(set(alone.codes[:, 1:].flatten().tolist())) > 1  # the predictor really sampled


def test_a_token_lm_samples_token_prompts_like_the_reference_alone_and_batched():
    """The thinker's path: G == 1 (no code predictor), token-id prompts, top-k/top-p,
    temperature, repetition penalty, a seed and stop ids, one token per step."""
    def sampled(seed, stop=()):
        return SamplingParams(temperature=0.8, top_k=12, top_p=0.9, repetition_penalty=1.3, seed=seed,
                              stop_token_ids=stop)

    free = reference_generate(TOKEN_LM, request(5, 16, sampled(3), rows=0, seed=30, token_ids=True)).codes
    stop = int(free[6, 0])
    mine = request(5, 16, sampled(3, (stop,)), rows=0, seed=30, token_ids=True)
    others = [(f"o{i}", request(2 + i, 10, sampled(40 + i), rows=0, seed=31 + i, token_ids=True)) for i in range(3)]
    alone = run(engine_for(TOKEN_LM), {0: [("me", mine)]})["me"]
    engine = engine_for(TOKEN_LM)
    batched = run(engine, {0: others[:2], 2: [("me", mine)] + others[2:]})
    expected, reason = (ref := reference_generate(TOKEN_LM, mine)).codes, ref.finish_reason
    assert reason == "stop" and 0 < expected.shape[0] <= 6 and stop not in expected[:, 0].tolist()
    for result in (alone, batched["me"]):
        assert result.finish_reason == "stop" and torch.equal(result.codes, expected)
    for request_id, inputs in others:
        assert torch.equal(batched[request_id].codes, reference_generate(TOKEN_LM, inputs).codes)
        assert batched[request_id].codes.shape == (10, 1)
    assert len(set(free[:, 0].tolist())) > 3  # it really sampled
    assert_nothing_held(engine)


def test_a_stop_id_ends_with_stop_and_its_frame_is_not_emitted():
    plain = reference_generate(MULTI, request(3, 12, seed=11)).codes[:, 0].tolist()
    stop = plain[3]
    first = plain.index(stop)
    inputs = request(3, 12, SamplingParams(temperature=0.0, stop_token_ids=(stop,)), seed=11)
    engine = engine_for()
    result = run(engine, {0: [("r", inputs)]})["r"]
    assert result.finish_reason == "stop" and result.codes.shape[0] == first
    assert stop not in result.codes[:, 0].tolist()
    assert_nothing_held(engine)


def test_min_new_tokens_masks_stop_ids_until_reached():
    plain = reference_generate(MULTI, request(3, 12, seed=11)).codes[:, 0].tolist()
    stop = plain[0]
    sampling = SamplingParams(temperature=0.0, stop_token_ids=(stop,), min_new_tokens=4)
    inputs = request(3, 12, sampling, seed=11)
    result = run(engine_for(), {0: [("r", inputs)]})["r"]
    expected = reference_generate(MULTI, inputs)
    codes, reason = expected.codes, expected.finish_reason
    assert torch.equal(result.codes, codes) and result.finish_reason == reason
    assert result.codes.shape[0] >= 4 and stop not in result.codes[:4, 0].tolist()


def test_max_new_tokens_ends_with_length():
    result = run(engine_for(), {0: [("r", request(2, 1))]})["r"]
    assert result.finish_reason == "length" and result.codes.shape == (1, 4)


def test_abort_mid_decode_frees_blocks_at_once():
    engine = engine_for()
    engine.add_request("a", request(3, 30))
    engine.add_request("b", request(3, 5, seed=1))
    streamed = {}
    for _ in range(3):
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(out.frame)
    held = engine.kv_blocks.num_free_blocks
    engine.abort("a")
    assert engine.kv_blocks.num_free_blocks > held and engine.live_requests() == {"b"}
    engine.abort("a")  # idempotent
    results = run(engine, {}, streamed)
    assert set(results) == {"b"} and results["b"].finish_reason == "length"
    assert_nothing_held(engine)


def test_a_tiny_kv_budget_queues_requests_instead_of_failing_them():
    # one block of 16 tokens per layer pair: 2 layers x 2 kv heads x 8 dims x 8 bytes x 2 (k, v)
    block_bytes = 2 * 2 * 2 * 8 * 8 * 16
    # 2 usable blocks (one is scratch): one request of max_model_len 32 fits, two do not
    engine = engine_for(kv_cache_bytes=3 * block_bytes, max_model_len=32)
    inputs = {f"r{i}": request(10, 12, seed=i) for i in range(3)}  # 21 tokens: 2 blocks each
    engine.add_request("r0", inputs["r0"])
    engine.add_request("r1", inputs["r1"])
    engine.add_request("r2", inputs["r2"])
    streamed = {"r0": [out.frame for out in engine.step()]}
    assert [s.request_id for s in engine.scheduler.running] == ["r0"] and len(engine.scheduler.waiting) == 2
    results = run(engine, {}, streamed)
    for request_id, each in inputs.items():
        assert torch.equal(results[request_id].codes, reference_generate(MULTI, each).codes)
    assert_nothing_held(engine)


def test_a_kv_pool_that_cannot_hold_one_request_of_max_model_len_refuses_to_build():
    """So a request within max_model_len always fits the pool: a request builder that
    checks max_model_len (before any model work) has checked the pool too."""
    block_bytes = 2 * 2 * 2 * 8 * 8 * 16
    with pytest.raises(ValueError, match="holds 32 tokens, fewer than one request of max_model_len 33"):
        engine_for(kv_cache_bytes=3 * block_bytes, max_model_len=33)
    assert engine_for(kv_cache_bytes=3 * block_bytes, max_model_len=32).kv_blocks.num_blocks == 2


def test_a_request_that_can_never_fit_is_rejected_up_front():
    with pytest.raises(RequestValidationError, match="max_model_len"):
        engine_for().add_request("long", request(100, 100))
    with pytest.raises(RequestValidationError, match="wide"):
        engine_for().add_request("narrow", request(3, 3, hidden=16))


def test_a_full_waiting_queue_raises_queue_full():
    engine = engine_for(max_waiting=2)
    engine.add_request("a", request(2, 2))
    engine.add_request("b", request(2, 2))
    with pytest.raises(QueueFullError):
        engine.add_request("c", request(2, 2))
    run(engine, {})
    assert_nothing_held(engine)


def test_a_failing_step_fails_only_its_batch_and_frees_its_blocks(monkeypatch):
    engine = engine_for(max_num_seqs=2)
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        engine.add_request(name, request(3, 6, seed=seed))
    engine.step()  # prefill a, b; c waits for a slot
    calls = []

    def failing_decode(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("device fault")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "decode", failing_decode)
        plan = engine.schedule()
        assert set(plan.request_ids) == {"a", "b"}
        with pytest.raises(RuntimeError, match="device fault"):
            engine.execute(plan)
    assert calls and engine.live_requests() == {"c"}
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
    results = run(engine, {})
    assert torch.equal(results["c"].codes, reference_generate(MULTI, request(3, 6, seed=3)).codes)
    assert_nothing_held(engine)


def test_the_engine_decides_its_prefill_attention_forms_at_construction():
    """Both prefill forms (whole prompts; over cached prefixes) are settled when the engine
    is built, before any request: on a CPU, the per-sequence loops."""
    attn = engine_for().runner.attn
    assert (attn.fused_prefill, attn.fused_prefix_prefill) == (False, False)


def test_a_request_on_an_idle_engine_is_prefilled_at_once():
    engine = engine_for(prefill_hold_ms=1000.0)
    engine.add_request("a", request(3, 5), now=0.0)
    assert engine.wait_hint(now=0.0) == 0.0
    assert engine.schedule(now=0.0).batch.kind == "prefill"


def test_prefills_are_coalesced_within_the_hold_window_while_others_decode():
    engine = engine_for(prefill_hold_ms=50.0)
    engine.add_request("z", request(2, 40, seed=9), now=0.0)
    streamed = {out.request_id: [out.frame] for out in engine.execute(engine.schedule(now=0.0))}
    engine.add_request("a", request(3, 5), now=0.0)
    plan = engine.schedule(now=0.01)
    assert plan.batch.kind == "decode"  # z decodes while a gathers
    for out in engine.execute(plan):
        streamed.setdefault(out.request_id, []).append(out.frame)
    assert engine.scheduler.hold_remaining(now=0.01) == pytest.approx(0.04)
    engine.add_request("b", request(4, 5, seed=1), now=0.02)
    plan = engine.schedule(now=0.051)
    assert plan.batch.kind == "prefill" and [s.request_id for s in plan.batch.seqs] == ["a", "b"]
    for out in engine.execute(plan):
        streamed.setdefault(out.request_id, []).append(out.frame)
    run(engine, {}, streamed)
    assert_nothing_held(engine)


def test_prefill_does_not_wait_when_the_waiting_requests_fill_every_free_slot():
    engine = engine_for(prefill_hold_ms=1000.0, max_num_seqs=2)
    engine.add_request("a", request(3, 5), now=0.0)
    engine.add_request("b", request(3, 5, seed=1), now=0.0)
    assert engine.schedule(now=0.0).batch.kind == "prefill"


def test_running_streams_keep_getting_frames_while_a_burst_is_prefilled_a_budget_at_a_time():
    engine = engine_for(max_num_seqs=8, max_prefill_tokens=8)
    arrivals = {0: [("z", request(3, 30, seed=9))], 2: [(f"b{i}", request(5, 6, seed=i)) for i in range(6)]}
    kinds, z_frames = [], []
    streamed: dict = {}
    results, step = {}, 0
    while engine.has_work() or step <= 2:
        for request_id, inputs in arrivals.get(step, []):
            engine.add_request(request_id, inputs)
        plan = engine.schedule()
        kinds.append(plan.batch.kind if plan.batch else None)
        outputs = engine.execute(plan)
        z_frames.append(any(o.request_id == "z" and o.frame is not None for o in outputs))
        for out in outputs:
            if out.frame is not None:
                streamed.setdefault(out.request_id, []).append(out.frame)
            if out.result is not None:
                results[out.request_id] = out.result
        step += 1
    burst = kinds[2:14]  # six prefills of one request each (5 + 5 tokens > the budget of 8)
    assert burst.count("prefill") == 6 and "prefill prefill" not in " ".join(map(str, burst))
    assert all(any(z_frames[i : i + 2]) for i in range(2, 14))  # z never waits two steps
    for request_id, inputs in [*arrivals[0], *arrivals[2]]:
        assert torch.equal(results[request_id].codes, reference_generate(MULTI, inputs).codes), request_id
        assert torch.equal(torch.cat(streamed[request_id]), results[request_id].codes)
    assert_nothing_held(engine)


# ---------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_talker(dtype):
    return ToyTalker(ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16), dtype, "cuda")


def cuda_request(length, max_new, seed, dtype, sampling=GREEDY):
    g = torch.Generator().manual_seed(seed)
    return GenerationInput(torch.randn(length, 64, generator=g).to(dtype), sampling, max_new,
                           step_rows=torch.randn(3, 64, generator=g).to(dtype),
                           pad_embed=torch.randn(64, generator=g).to(dtype))


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_with_graphs_equals_the_reference_loop(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = cuda_talker(torch.float32)
    engine = AREngine(model, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=8, max_model_len=256,
                                          prefill_hold_ms=0.0, cuda_graph_batch_sizes=(1, 2, 4, 8)))
    assert engine.graphs is not None and engine.overlap
    arrivals = {0: [(f"r{i}", cuda_request(3 + i, 10 + 3 * i, i, torch.float32)) for i in range(5)],
                4: [(f"s{i}", cuda_request(5, 8, 10 + i, torch.float32)) for i in range(4)]}
    results = run(engine, arrivals)
    for inputs_list in arrivals.values():
        for request_id, inputs in inputs_list:
            assert torch.equal(results[request_id].codes.cpu(), reference_generate(model, inputs).codes.cpu()), request_id
    assert_nothing_held(engine)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_equals_eager_decode():
    model = cuda_talker(torch.bfloat16)
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=5)
    arrivals = {0: [(f"r{i}", cuda_request(4 + i, 20, i, torch.bfloat16, sampling)) for i in range(6)]}
    outputs = []
    for sizes in ((), (1, 2, 4, 8)):
        engine = AREngine(model, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=8, max_model_len=256,
                                              prefill_hold_ms=0.0, cuda_graph_batch_sizes=sizes))
        outputs.append(run(engine, arrivals))
        assert_nothing_held(engine)
    for request_id in outputs[0]:
        assert torch.equal(outputs[0][request_id].codes, outputs[1][request_id].codes), request_id
