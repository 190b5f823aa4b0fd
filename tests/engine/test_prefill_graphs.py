"""Prefill graphs: a prefill laid out as padded rows of a decode-like forward
(``ModelRunner.prefill_rows`` + ``forward_rows``, what a prefill graph replays) computes
what the eager variable-length prefill does (last hidden, every KV slot but the scratch
block's), at any length up to its bucket and over cached prefixes; on CUDA the engine
replays it for small prefills and generates what the reference loop does."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.model_runner import prompt_kv_slots
from omnistage.engine.reference import reference_generate
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker
from tests.engine.test_engine import DTYPE, GREEDY, MULTI, assert_nothing_held, run
from tests.engine.test_mrope import image_positions

THINKER = ToyTalker(
    ToyARConfig(num_code_groups=1, mrope=True, head_dim=12, hidden_layers=(0, 2)), DTYPE
)
PREFIX = torch.randn(
    40, 32, generator=torch.Generator().manual_seed(5), dtype=DTYPE
)  # 2 full blocks and 8 rows


def prompt_request(length, seed, prefix=None, max_new=6, width=32):
    """``length`` random rows after ``prefix`` (then with ``cache_prompt``), ``width`` wide."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randn(length, width, generator=g, dtype=DTYPE)
    if prefix is not None:
        prompt = torch.cat([prefix, prompt])
    return GenerationInput(
        prompt,
        GREEDY,
        max_new,
        step_rows=torch.randn(2, width, generator=g, dtype=DTYPE),
        pad_embed=torch.randn(width, generator=g, dtype=DTYPE),
        cache_prompt=prefix is not None,
    )


def thinker_request(seed):
    positions, delta = image_positions(3, (2, 3), 4)
    prompt = torch.randint(
        0, 64, (positions.shape[1],), generator=torch.Generator().manual_seed(seed)
    )
    return GenerationInput(
        prompt, GREEDY, 4, positions=positions, rope_delta=delta, return_hidden=True
    )


def cpu_engine(model):
    return AREngine(
        model,
        EngineConfig(
            kv_cache_bytes=1 << 20,
            max_model_len=128,
            prefill_hold_ms=0.0,
            max_num_seqs=4,
            num_step_rows=256,
        ),
    )


def scheduled_prefill(engine, requests, warm=()):
    """Run ``warm`` requests through ``engine`` (they leave their prefix cached), then
    admit ``requests`` as one prefill batch and write their slots, as a step does."""
    if warm:
        run(engine, {0: list(warm)})
    for request_id, inputs in requests:
        engine.add_request(request_id, inputs)
    batch = engine.schedule().batch
    assert batch is not None and batch.kind == "prefill" and len(batch.seqs) == len(requests)
    for seq in batch.seqs:
        engine.runner.admit(seq)
    return batch.seqs


def padded_prefill(engine, seqs, size):
    """The rows path as a prefill graph runs it, on garbage padding inputs."""
    runner, spec = engine.runner, engine.runner.spec
    rows = runner.prefill_rows(seqs, size)
    embeds = 1e3 * torch.randn(
        size, spec.hidden_size, dtype=spec.dtype
    )  # padding rows: anything finite
    embeds[: rows.num_tokens] = rows.embeds
    hidden, layers = runner.forward_rows(rows.meta, embeds, rows.positions)
    slot_ids, last = rows.ends
    return hidden[last], slot_ids, None if layers is None else layers[: rows.num_tokens]


def assert_same_kv_but_scratch(eager, padded, padding_rows):
    """Every slot of the two pools agrees but the scratch block's, which only the padded
    path's padding rows wrote."""
    scratch = eager.cache.scratch_block * eager.cache.block_size
    for pool_eager, pool_padded in (
        (eager.cache.k, padded.cache.k),
        (eager.cache.v, padded.cache.v),
    ):
        torch.testing.assert_close(
            pool_padded[:, :scratch], pool_eager[:, :scratch], rtol=1e-9, atol=1e-9
        )
        assert not pool_eager[:, scratch:].any()
        assert bool(pool_padded[:, scratch:].any()) == (padding_rows > 0)


@pytest.mark.parametrize(
    ("suffixes", "size", "prefixed"),
    [
        ((1,), 16, False),
        ((15,), 16, False),
        ((16,), 16, False),
        ((17,), 32, False),
        ((32,), 32, False),
        ((5, 11), 16, False),
        ((3, 9, 4), 64, False),
        ((1,), 16, True),
        ((8,), 16, True),
        ((9,), 32, True),
        ((3, 13), 32, True),
        ((6, 10), 64, True),
    ],
)
def test_padded_prefill_rows_equal_the_eager_prefill(suffixes, size, prefixed):
    prefix = PREFIX if prefixed else None
    warm = [("warm", prompt_request(4, 99, prefix))] if prefixed else []
    requests = [(f"r{i}", prompt_request(n, i, prefix)) for i, n in enumerate(suffixes)]
    eager, padded = cpu_engine(MULTI), cpu_engine(MULTI)
    seqs_eager, seqs_padded = (scheduled_prefill(e, requests, warm) for e in (eager, padded))
    # with the prefix cached, a request computes its 8 prefix rows past the 2 cached blocks
    assert [s.num_cached for s in seqs_padded] == [32 if prefixed else 0] * len(suffixes)
    computed = sum(s.prompt_len - s.num_cached for s in seqs_padded)
    assert computed <= size
    last, slot_ids, _ = eager.runner.prefill(seqs_eager)
    last_rows, slot_ids_rows, _ = padded_prefill(padded, seqs_padded, size)
    assert torch.equal(slot_ids, slot_ids_rows)
    torch.testing.assert_close(last_rows, last, rtol=1e-9, atol=1e-9)
    assert_same_kv_but_scratch(eager, padded, size - computed)


def test_padded_prefill_rows_take_multimodal_positions_and_return_hidden_layers():
    requests = [(f"t{i}", thinker_request(i)) for i in range(2)]
    eager, padded = cpu_engine(THINKER), cpu_engine(THINKER)
    seqs_eager, seqs_padded = (scheduled_prefill(e, requests) for e in (eager, padded))
    last, _, layers = eager.runner.prefill(seqs_eager)
    last_rows, _, layers_rows = padded_prefill(padded, seqs_padded, 32)
    torch.testing.assert_close(last_rows, last, rtol=1e-9, atol=1e-9)
    assert layers is not None and layers_rows is not None and layers_rows.shape == layers.shape
    torch.testing.assert_close(layers_rows, layers, rtol=1e-9, atol=1e-9)
    assert_same_kv_but_scratch(eager, padded, 32 - layers.shape[0])


def test_a_prefill_larger_than_its_rows_is_refused():
    engine = cpu_engine(MULTI)
    seqs = scheduled_prefill(engine, [("r", prompt_request(17, 0))])
    with pytest.raises(ValueError, match="17 tokens does not fit 16 rows"):
        engine.runner.prefill_rows(seqs, 16)


@pytest.mark.parametrize("tokens", [(0,), (16, -32), (16.0,), (True,), (8193,), ("16",)])
def test_bad_prefill_graph_buckets_are_refused(tokens):
    with pytest.raises(
        ValueError, match="cuda_graph_prefill_tokens must be token counts in 1..max_prefill_tokens"
    ):
        EngineConfig(cuda_graph_prefill_tokens=tokens)


def test_the_default_prefill_buckets_stop_at_max_prefill_tokens():
    assert EngineConfig().prefill_graph_tokens() == [16, 32, 64, 128]
    assert EngineConfig(max_prefill_tokens=40).prefill_graph_tokens() == [16, 32]
    assert EngineConfig(cuda_graph_prefill_tokens=(64, 16, 64)).prefill_graph_tokens() == [16, 64]
    assert EngineConfig(cuda_graph_prefill_tokens=()).prefill_graph_tokens() == []


# ---------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_CONFIG = ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)


def to_cuda(inputs: GenerationInput, dtype) -> GenerationInput:
    def move(t):
        return None if t is None else t.to("cuda", dtype)

    return GenerationInput(
        move(inputs.prompt),
        inputs.sampling,
        inputs.max_new_tokens,
        step_rows=move(inputs.step_rows),
        pad_embed=move(inputs.pad_embed),
        cache_prompt=inputs.cache_prompt,
    )


def counting_eager_prefills(monkeypatch, engine):
    calls = []
    eager = engine.runner.prefill

    def prefill(seqs):
        calls.append([s.request_id for s in seqs])
        return eager(seqs)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    return calls


@pytest.mark.gpu
@needs_cuda
def test_cuda_prefill_graphs_generate_what_the_reference_loop_does(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = ToyTalker(CUDA_CONFIG, torch.float32, "cuda")  # the Triton kernel: head_dim >= 16
    engine = AREngine(
        model,
        EngineConfig(
            kv_cache_bytes=16 << 20,
            max_num_seqs=8,
            max_model_len=128,
            prefill_hold_ms=0.0,
            num_step_rows=256,
            cuda_graph_batch_sizes=(1, 2, 4, 8),
            cuda_graph_prefill_tokens=(16, 32),
        ),
    )
    assert engine.graphs is not None and engine.graphs.prefill_tokens == [16, 32]
    eager_calls = counting_eager_prefills(monkeypatch, engine)
    prefix = torch.randn(40, 64, generator=torch.Generator().manual_seed(5), dtype=DTYPE)
    turns = [
        [
            ("warm", prompt_request(4, 99, prefix, width=64))
        ],  # 44 tokens: eager, leaves the prefix cached
        [
            ("edge", prompt_request(8, 1, prefix, width=64))
        ],  # 8 + 8 after the hit: the 16 bucket's edge
        [("over", prompt_request(9, 2, prefix, width=64))],  # 17: the 32 bucket
        [
            ("a", prompt_request(16, 3, width=64)),
            ("b", prompt_request(16, 4, width=64)),
        ],  # 32 in one prefill, no prefix
        [("one", prompt_request(1, 5, width=64))],
    ]
    results = {}
    for turn in turns:
        results |= run(engine, {0: [(rid, to_cuda(inputs, torch.float32)) for rid, inputs in turn]})
    assert eager_calls == [["warm"]]
    assert engine.prefix_hit_tokens == 2 * 32
    for turn in turns:
        for request_id, inputs in turn:
            expected = reference_generate(model, to_cuda(inputs, torch.float32)).codes.cpu()
            assert torch.equal(results[request_id].codes.cpu(), expected), request_id
    assert_nothing_held(engine)


@pytest.mark.gpu
@needs_cuda
def test_cuda_prefill_graph_replay_matches_the_eager_prefill_in_bf16():
    model = ToyTalker(
        ToyARConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, num_layers=4),
        torch.bfloat16,
        "cuda",
    )
    config = dict(
        kv_cache_bytes=64 << 20,
        max_num_seqs=4,
        max_model_len=256,
        prefill_hold_ms=0.0,
        num_step_rows=256,
        cuda_graph_batch_sizes=(1, 2, 4),
    )
    g = torch.Generator().manual_seed(0)
    prefix = torch.randn(96, 256, generator=g).to(torch.bfloat16)

    def voice(seed, length):
        rows = torch.randn(length, 256, generator=torch.Generator().manual_seed(seed))
        return GenerationInput(
            torch.cat([prefix, rows.to(torch.bfloat16)]).cuda(), GREEDY, 4, cache_prompt=True
        )

    outputs = []
    for tokens in ((), (16, 32, 64)):
        engine = AREngine(model, EngineConfig(**config, cuda_graph_prefill_tokens=tokens))
        run(engine, {0: [("warm", voice(99, 3))]})
        seqs = scheduled_prefill(engine, [("r0", voice(1, 14)), ("r1", voice(2, 30))])
        assert [s.num_cached for s in seqs] == [96, 96]
        graphs = engine.graphs
        assert graphs is not None and graphs.fits_prefill(seqs) == bool(tokens)
        with torch.no_grad():
            last, _, _ = graphs.prefill(seqs) if tokens else engine.runner.prefill(seqs)
        slots = torch.from_numpy(np.concatenate([prompt_kv_slots(s, 16) for s in seqs])).cuda()
        kv = torch.stack(
            [engine.cache.k.index_select(1, slots), engine.cache.v.index_select(1, slots)]
        )
        outputs.append((last.float().cpu(), kv.float().cpu()))
    (last_eager, kv_eager), (last_graph, kv_graph) = outputs
    torch.testing.assert_close(last_graph, last_eager, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(kv_graph, kv_eager, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@needs_cuda
def test_cuda_prefill_graphs_take_multimodal_positions_and_return_hidden_layers(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = ToyTalker(
        ToyARConfig(num_code_groups=1, mrope=True, head_dim=16, hidden_layers=(0, 2)),
        torch.float32,
        "cuda",
    )
    outputs = []
    for tokens in ((), (16, 32)):
        engine = AREngine(
            model,
            EngineConfig(
                kv_cache_bytes=16 << 20,
                max_num_seqs=4,
                max_model_len=128,
                prefill_hold_ms=0.0,
                num_step_rows=64,
                cuda_graph_prefill_tokens=tokens,
            ),
        )
        for i in range(2):
            engine.add_request(f"t{i}", thinker_request(i))
        steps = engine.step()  # the prefill (frame 0 and the prompt's hidden rows)
        outputs.append({out.request_id: (out.frame.cpu(), out.hidden.cpu()) for out in steps})
    for request_id, (frame, hidden) in outputs[0].items():
        graph_frame, graph_hidden = outputs[1][request_id]
        assert torch.equal(graph_frame, frame), request_id
        torch.testing.assert_close(graph_hidden, hidden, rtol=1e-4, atol=1e-4)


def test_prompt_kv_slots_are_each_tokens_block_and_offset():
    seq = SimpleNamespace(prompt_len=37, block_table=[9, 2, 14, 5])
    expected = [seq.block_table[t // 16] * 16 + t % 16 for t in range(37)]
    slots = prompt_kv_slots(seq, 16)
    assert slots.dtype == np.int64 and slots.tolist() == expected
