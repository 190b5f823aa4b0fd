"""Prefix caching: a prompt that begins with blocks another prompt computed reuses their
KV (keyed by the embeddings' content) and generates exactly what a fresh prefill does;
shared blocks are counted, freed with their last holder, evicted only when unheld."""

import pytest
import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput, block_keys, prompt_row_keys
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker
from tests.engine.test_engine import DTYPE, GREEDY, MULTI, assert_nothing_held, engine_for, run

PREFIX = torch.randn(40, 32, generator=torch.Generator().manual_seed(5), dtype=DTYPE)  # 2 full blocks of 16 and 8 rows


def voice_request(suffix_seed: int, sampling=GREEDY, suffix_len: int = 6, prefix=PREFIX, cache=True) -> GenerationInput:
    g = torch.Generator().manual_seed(suffix_seed)
    prompt = torch.cat([prefix, torch.randn(suffix_len, 32, generator=g, dtype=DTYPE)])
    return GenerationInput(
        prompt, sampling, 8, step_rows=torch.randn(3, 32, generator=g, dtype=DTYPE),
        pad_embed=torch.randn(32, generator=g, dtype=DTYPE), cache_prompt=cache,
        predictor_sampling=None if sampling is GREEDY else SamplingParams(temperature=0.9, top_k=5, seed=3),
    )


def _run_in_turn(engine, requests):
    """One request after the other (each one's prefill after the previous one's)."""
    results = {}
    for i, (request_id, inputs) in enumerate(requests):
        results |= run(engine, {0: [(request_id, inputs)]})
        assert engine.prefix_hit_tokens == 32 * i, request_id  # every later one reused 2 blocks
    return results


def test_a_reused_prefix_generates_what_a_fresh_prefill_does_greedy_and_seeded():
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=11)
    requests = [("a", voice_request(1)), ("b", voice_request(2)), ("c", voice_request(3, seeded)), ("d", voice_request(1, seeded))]
    engine = engine_for(max_model_len=64)
    results = _run_in_turn(engine, requests)
    for request_id, inputs in requests:
        fresh = run(engine_for(max_model_len=64, prefix_caching=False), {0: [(request_id, inputs)]})[request_id]
        assert torch.equal(results[request_id].codes, fresh.codes), request_id
        assert torch.equal(results[request_id].codes, reference_generate(MULTI, inputs).codes), request_id
    assert_nothing_held(engine)
    assert engine.kv_blocks.num_cached_blocks >= 2  # the prefix stays cached, unheld


def test_requests_sharing_a_prefix_in_one_batch_decode_together_exactly():
    engine = engine_for(max_model_len=64)
    run(engine, {0: [("first", voice_request(1))]})
    batch = [(f"r{i}", voice_request(10 + i, suffix_len=3 + i)) for i in range(3)]
    results = run(engine, {0: batch})
    assert engine.prefix_hit_tokens == 3 * 32
    for request_id, inputs in batch:
        assert torch.equal(results[request_id].codes, reference_generate(MULTI, inputs).codes), request_id
    assert_nothing_held(engine)


def test_a_prompt_whose_content_differs_gets_no_cached_block():
    engine = engine_for(max_model_len=64)
    run(engine, {0: [("a", voice_request(1))]})
    other = PREFIX.clone()
    other[0, 0] += 1e-6  # one value of the first row: not the same voice
    run(engine, {0: [("b", voice_request(2, prefix=other))]})
    run(engine, {0: [("c", voice_request(3, cache=False))]})  # not asking for the cache
    assert engine.prefix_hit_tokens == 0


def test_unheld_cached_blocks_are_evicted_when_the_pool_needs_them():
    # 5 blocks of 16: "a" (46 + 7 tokens, 4 blocks) leaves its 2 prefix blocks registered;
    # "big" (70 + 7 tokens) then needs all 5
    geometry = engine_for(max_model_len=80, max_num_seqs=1)  # only read for the bytes of a block
    engine = engine_for(max_model_len=80, kv_cache_bytes=_bytes_for_blocks(geometry, 5), max_num_seqs=1)
    assert engine.kv_blocks.num_blocks == 5
    run(engine, {0: [("a", voice_request(1))]})
    assert engine.kv_blocks.num_cached_blocks == 2
    big = GenerationInput(torch.randn(70, 32, dtype=DTYPE), GREEDY, 8, cache_prompt=True)
    result = run(engine, {0: [("big", big)]})["big"]
    assert torch.equal(result.codes, reference_generate(MULTI, big).codes)
    late = voice_request(2)
    assert torch.equal(run(engine, {0: [("late", late)]})["late"].codes, reference_generate(MULTI, late).codes)
    assert engine.prefix_hit_tokens == 0  # the voice's blocks had been evicted for "big"
    assert_nothing_held(engine)


def _bytes_for_blocks(engine, blocks: int) -> int:
    per_block = engine.cache.k[0].element_size() * engine.cache.k[0][0].numel() * engine.config.block_size
    return 2 * per_block * len(engine.cache.k) * (blocks + 1)  # + the scratch block


def test_a_shared_block_returns_to_the_pool_with_its_last_holder_and_is_reused_last():
    manager = BlockManager(num_blocks=4, block_size=4)
    keys = block_keys(prompt_row_keys(torch.arange(8)), 4)
    table = manager.allocate("a", 10)
    manager.register("a", keys)
    cached = manager.match(keys)
    assert cached == table[:2] and manager.can_allocate(10, cached)
    manager.allocate("b", 10, cached)  # 2 shared + 1 new
    assert manager.num_free_blocks == 0
    manager.release("a")
    assert manager.num_free_blocks == 1  # a's own third block; the shared two are b's still
    manager.release("b")
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2
    manager.allocate("c", 8)  # two never-registered blocks first: the cached pair survives
    assert manager.match(keys) == cached
    manager.allocate("d", 4)  # now the least recently released cached block goes
    assert len(manager.match(keys)) < 2
    assert manager.num_free_blocks == 1


def test_block_keys_chain_every_row_before_them():
    rows = prompt_row_keys(torch.arange(12))
    changed = prompt_row_keys(torch.cat([torch.tensor([99]), torch.arange(1, 12)]))
    assert len(block_keys(rows, 4)) == 3 and len(block_keys(rows, 5)) == 2
    assert all(a != b for a, b in zip(block_keys(rows, 4), block_keys(changed, 4), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefix_reuse_with_graphs_and_overlap_equals_a_fresh_prefill(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = ToyTalker(ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16), torch.float32, "cuda")
    prefix = torch.randn(40, 64, generator=torch.Generator().manual_seed(5)).cuda()

    def voice(seed: int) -> GenerationInput:
        g = torch.Generator().manual_seed(seed)
        prompt = torch.cat([prefix, torch.randn(5 + seed % 3, 64, generator=g).cuda()])
        return GenerationInput(prompt, GREEDY, 10, step_rows=torch.randn(3, 64, generator=g).cuda(),
                               pad_embed=torch.randn(64, generator=g).cuda(), cache_prompt=True)

    config = EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=4, max_model_len=128, prefill_hold_ms=0.0,
                          cuda_graph_batch_sizes=(1, 2, 4))
    engine = AREngine(model, config)
    first = run(engine, {0: [("a", voice(1))]})
    later = run(engine, {0: [("b", voice(2)), ("c", voice(3))], 2: [("d", voice(4))]})
    assert engine.prefix_hit_tokens == 3 * 32
    for request_id, inputs in [("a", voice(1)), ("b", voice(2)), ("c", voice(3)), ("d", voice(4))]:
        got = (first | later)[request_id].codes.cpu()
        assert torch.equal(got, reference_generate(model, inputs).codes.cpu()), request_id
    assert_nothing_held(engine)
