"""The overlapped engine (``EngineConfig.overlap``: step t+1 launched before step t's frames
are read; a prefill step also decodes the running requests) on the CPU, where it is forced
on: every request gets the same frames, token for token, as without overlap and as the
unbatched reference loop, under staggered arrivals, stops at different steps (found one
step late), length stops, aborts and failures mid-run, streamed rows and lowered caps, and
nothing is left held afterwards."""

from dataclasses import replace

import pytest
import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.engine_runs import EngineRun, run_arrivals
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

DTYPE = torch.float64  # batched and unbatched matmuls then agree far below any logit gap
GREEDY = SamplingParams(temperature=0.0)
MULTI = ToyTalker(ToyARConfig(), DTYPE)
TOKEN_LM = ToyTalker(ToyARConfig(num_code_groups=1), DTYPE)


def request(length, max_new, sampling=GREEDY, rows=2, seed=0, predictor=None, token_ids=False):
    g = torch.Generator().manual_seed(seed)
    prompt = (
        torch.randint(0, 64, (length,), generator=g)
        if token_ids
        else torch.randn(length, 32, generator=g, dtype=DTYPE)
    )
    return GenerationInput(
        prompt, sampling, max_new,
        step_rows=torch.randn(rows, 32, generator=g, dtype=DTYPE) if rows else None,
        pad_embed=torch.randn(32, generator=g, dtype=DTYPE), predictor_sampling=predictor,
    )  # fmt: skip


def engine_for(overlap, model=MULTI, **overrides):
    config = dict(
        kv_cache_bytes=1 << 20,
        max_model_len=128,
        prefill_hold_ms=0.0,
        max_num_seqs=4,
        num_step_rows=512,
    )
    engine = AREngine(model, EngineConfig(**(config | overrides), overlap=overlap))
    assert engine.overlap is overlap
    return engine


def assert_nothing_held(engine):
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
    assert engine.row_blocks.num_free_blocks == engine.row_blocks.num_blocks
    assert not engine.live_requests() and not engine.has_work() and not engine.scheduler.running


def assert_same_run(plain: EngineRun, overlapped: EngineRun):
    assert plain.results.keys() == overlapped.results.keys()
    for request_id, result in plain.results.items():
        other = overlapped.results[request_id]
        assert other.finish_reason == result.finish_reason, request_id
        assert torch.equal(other.codes, result.codes), request_id
        frames = overlapped.frames.get(request_id, [])
        assert torch.equal(torch.cat(frames) if frames else other.codes, other.codes), request_id


def both(arrivals, model=MULTI, **overrides):
    """Run ``arrivals`` without and with overlap; asserts the same frames and results and
    nothing held after either. Returns the plain run."""
    runs = []
    for overlap in (False, True):
        engine = engine_for(overlap, model, **overrides)
        runs.append(run_arrivals(engine, arrivals))
        assert_nothing_held(engine)
    assert_same_run(*runs)
    return runs[0]


def stop_at(model, inputs, index):
    """``inputs`` with a stop id, code 0 of its reference frame ``index``, and the frames it
    then emits (greedy or seeded draws are fixed: it stops at that id's first occurrence)."""
    free = reference_generate(model, inputs).codes[:, 0].tolist()
    stop = free[index]
    return replace(inputs, sampling=replace(inputs.sampling, stop_token_ids=(stop,))), free.index(
        stop
    )


@pytest.mark.parametrize("model", [MULTI, TOKEN_LM], ids=["16-codebook-like", "token-lm"])
def test_staggered_arrivals_equal_the_plain_engine_and_the_reference(model):
    token_ids = model is TOKEN_LM
    arrivals = {
        0: [("a", request(3, 9, seed=1)), ("b", request(7, 4, seed=2, token_ids=token_ids))],
        2: [("c", request(1, 12, seed=3, rows=0))],
        3: [
            ("d", request(5, 2, seed=4, rows=5)),
            ("e", request(2, 6, seed=5)),
            ("f", request(4, 1, seed=6)),
        ],
        9: [("g", request(4, 5, seed=7, token_ids=token_ids))],  # d, e, f, g wait for slots
    }
    results = both(arrivals, model).results
    for inputs_list in arrivals.values():
        for request_id, inputs in inputs_list:
            assert results[request_id].finish_reason == "length"
            assert torch.equal(
                results[request_id].codes, reference_generate(model, inputs).codes
            ), request_id


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_stops_at_different_steps_found_a_step_late_equal_the_plain_engine(sampled):
    """Stop ids end requests at different frames (at most 0, 1, 3 and 6; the overlapped
    engine has launched each one's next step already: that frame is dropped) beside length
    stops, with newcomers taking the freed slots."""

    def sampling(seed):
        if not sampled:
            return GREEDY
        return SamplingParams(
            temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=seed
        )

    predictor = SamplingParams(temperature=0.9, top_k=5, seed=3) if sampled else None
    stops = {}
    for name, (index, seed) in {"s0": (0, 11), "s1": (1, 12), "s3": (3, 13), "s6": (6, 14)}.items():
        stops[name], stops[name + "_len"] = stop_at(
            MULTI, request(3, 12, sampling(seed), seed=seed, predictor=predictor), index
        )
    arrivals = {
        0: [
            ("s3", stops["s3"]),
            ("long", request(2, 20, sampling(1), seed=1, predictor=predictor)),
            ("s0", stops["s0"]),
        ],
        1: [
            ("s1", stops["s1"]),
            ("s6", stops["s6"]),
            ("short", request(4, 3, sampling(2), seed=2, predictor=predictor)),
        ],
        5: [("late", request(3, 7, sampling(4), seed=4, predictor=predictor))],
    }
    results = both(arrivals).results
    assert len({stops[name + "_len"] for name in ("s0", "s1", "s3", "s6")}) >= 3
    for name in ("s0", "s1", "s3", "s6"):
        assert (
            results[name].finish_reason == "stop"
            and results[name].codes.shape[0] == stops[name + "_len"]
        ), name
    for name, inputs in [
        ("long", arrivals[0][1][1]),
        ("short", arrivals[1][2][1]),
        ("late", arrivals[5][0][1]),
    ]:
        assert results[name].finish_reason == "length"
        assert torch.equal(results[name].codes, reference_generate(MULTI, inputs).codes), name


def test_a_prefill_step_decodes_the_running_requests_and_resolves_its_first_frames_at_once():
    engine = engine_for(True, max_num_seqs=8, max_prefill_tokens=8)
    arrivals = {
        0: [("z", request(3, 30, seed=9))],
        2: [(f"b{i}", request(5, 6, seed=i)) for i in range(6)],
    }
    kinds, z_frames, first_frames, step = [], [], {}, 0
    while engine.has_work() or step <= 2:
        for request_id, inputs in arrivals.get(step, []):
            engine.add_request(request_id, inputs)
        plan = engine.schedule()
        kinds.append(
            (plan.batch.kind, [s.request_id for s in plan.batch.decode]) if plan.batch else None
        )
        outputs = engine.execute(plan)
        z_frames.append(any(o.request_id == "z" and o.frame is not None for o in outputs))
        for out in outputs:
            first_frames.setdefault(out.request_id, step)
        step += 1
    burst = kinds[2:8]  # six prefills of one request each (5 + 5 tokens > the budget of 8)
    assert [kind for kind, _ in burst] == ["prefill"] * 6
    assert all("z" in decode for _, decode in burst)  # z decodes in every prefill step
    assert burst[1][1] == ["z", "b0"]  # the running ones from before the admission
    # z: frame 0 from its prefill (step 0), frame 1 resolved in step 2, then one every step
    assert z_frames[:2] == [True, False] and all(z_frames[2:31]) and not any(z_frames[31:])
    for i in range(6):  # each newcomer's first frame comes out of its own prefill step
        assert first_frames[f"b{i}"] == 2 + i
    assert_nothing_held(engine)


def test_aborts_mid_run_free_everything_and_leave_the_others_equal():
    """``a`` is aborted with a step of it in flight, ``b`` while waiting for a slot, ``c``
    right after its prefill; the others equal the plain engine's."""
    inputs = {
        "a": request(3, 30, seed=1),
        "b": request(4, 8, seed=2),
        "c": request(2, 9, seed=3),
        "d": request(5, 6, seed=4),
        "e": request(3, 7, seed=5),
        "f": request(2, 5, seed=6),
    }
    arrivals = {0: ["a", "d", "e", "f"], 1: ["b"], 4: ["c"]}
    aborts = {3: ["a", "b"], 7: ["c"]}  # before that step
    runs = []
    for overlap in (False, True):
        engine = engine_for(overlap)
        run, step, aborted = EngineRun(), 0, set()
        while engine.has_work() or step <= max(arrivals):
            for request_id in aborts.get(step, []):
                engine.abort(request_id)
                engine.abort(request_id)  # idempotent
                aborted.add(request_id)
            for request_id in arrivals.get(step, []):
                engine.add_request(request_id, inputs[request_id])
            for out in engine.step():
                assert out.request_id not in aborted  # a frame in flight is dropped
                if out.frame is not None:
                    run.frames.setdefault(out.request_id, []).append(out.frame)
                if out.result is not None:
                    run.results[out.request_id] = out.result
            step += 1
        assert_nothing_held(engine)
        runs.append(run)
    assert_same_run(*runs)
    assert set(runs[1].results) == {"d", "e", "f"}
    for request_id in "ac":  # the frames streamed before the abort: a prefix of the reference's
        reference = reference_generate(MULTI, inputs[request_id]).codes
        for run in runs:
            frames = torch.cat(run.frames[request_id])
            assert 0 < frames.shape[0] < reference.shape[0] and torch.equal(
                frames, reference[: frames.shape[0]]
            )
    assert "b" not in runs[1].frames


def test_a_stage_stop_and_a_lowered_cap_mid_run_equal_the_plain_engine():
    """``engine.stop`` (a stop string found by the stage) after a frame, and
    ``cap_new_tokens`` lowered while a step of the request is in flight."""
    inputs = {"s": request(3, 20, seed=1), "c": request(4, 20, seed=2), "o": request(2, 12, seed=3)}
    runs = []
    for overlap in (False, True):
        engine = engine_for(overlap)
        for request_id, given in inputs.items():
            engine.add_request(request_id, given)
        run = EngineRun()
        while engine.has_work():
            for out in engine.step():
                if out.frame is not None:
                    frames = run.frames.setdefault(out.request_id, [])
                    frames.append(out.frame)
                    if out.request_id == "s" and len(frames) == 4:
                        engine.stop("s")
                    if out.request_id == "c" and len(frames) == 3:
                        engine.cap_new_tokens(
                            "c", 2
                        )  # below what was launched: ends at the launched ones
                if out.result is not None:
                    run.results[out.request_id] = out.result
        assert_nothing_held(engine)
        runs.append(run)
    plain, overlapped = runs
    assert (
        "s" not in overlapped.results and len(overlapped.frames["s"]) == len(plain.frames["s"]) == 4
    )
    assert torch.equal(torch.cat(overlapped.frames["s"]), torch.cat(plain.frames["s"]))
    # the cap is at least the frames launched and one past those emitted: 4 either way
    assert plain.results["c"].finish_reason == overlapped.results["c"].finish_reason == "length"
    expected = reference_generate(MULTI, inputs["c"]).codes[:4]
    assert torch.equal(plain.results["c"].codes, expected) and torch.equal(
        overlapped.results["c"].codes, expected
    )
    assert torch.equal(overlapped.results["o"].codes, plain.results["o"].codes)


def test_streamed_rows_equal_all_rows_at_once_with_overlap():
    """Rows appended while a step is in flight: a request waits for its next row out of
    the batch and samples as if every row had been given."""
    full = {f"s{i}": request(3 + i, 10, rows=6, seed=i) for i in range(3)}
    engine = engine_for(True)
    for request_id, given in full.items():
        head = given.step_rows[:1]
        engine.add_request(request_id, GenerationInput(given.prompt, given.sampling, given.max_new_tokens, head,
                                                       given.pad_embed, more_rows=True))  # fmt: skip
    sent = dict.fromkeys(full, 1)
    results, step = {}, 0
    while engine.has_work():
        for i, (request_id, given) in enumerate(full.items()):
            if step % (i + 1) == 0 and sent[request_id] <= given.step_rows.shape[0]:
                if sent[request_id] < given.step_rows.shape[0]:
                    engine.append_step_rows(
                        request_id, given.step_rows[sent[request_id] : sent[request_id] + 1]
                    )
                else:
                    engine.complete_step_rows(request_id)
                sent[request_id] += 1
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
        step += 1
    for request_id, given in full.items():
        assert torch.equal(results[request_id].codes, reference_generate(MULTI, given).codes), (
            request_id
        )
    assert_nothing_held(engine)


@pytest.mark.parametrize("where", ["decode", "follow decode"])
def test_a_failing_step_fails_its_launched_and_in_flight_requests(monkeypatch, where):
    """A decode that raises while a step is in flight (or the decode of a prefill step)
    ends every request of the plan, its in-flight ones included; a waiting one runs on."""
    engine = engine_for(True, max_num_seqs=3)
    for name, seed in (("a", 1), ("b", 2)):
        engine.add_request(name, request(3, 8, seed=seed))
    engine.step()  # prefill a, b
    engine.step()  # decode a, b: in flight
    if where == "follow decode":
        engine.add_request("n", request(2, 5, seed=4))
        engine.add_request("w", request(3, 6, seed=3))  # waits for a slot

    def failing_decode(*args, **kwargs):
        raise RuntimeError("device fault")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "decode", failing_decode)
        plan = engine.schedule()
        expected = {"a", "b", "n"} if where == "follow decode" else {"a", "b"}
        assert set(plan.request_ids) == expected
        with pytest.raises(RuntimeError, match="device fault"):
            engine.execute(plan)
    assert engine.live_requests() == ({"w"} if where == "follow decode" else set())
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
    arrivals = {} if where == "follow decode" else {0: [("w", request(3, 6, seed=3))]}
    results = run_arrivals(engine, arrivals).results
    assert set(results) == {"w"} and torch.equal(
        results["w"].codes, reference_generate(MULTI, request(3, 6, seed=3)).codes
    )
    assert_nothing_held(engine)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlap_with_graphs_equals_the_plain_engine_and_the_reference(monkeypatch):
    """On CUDA with graphs: prefill steps that decode the running requests, stops found a
    step late, staggered arrivals; fp32 without TF32, so batching changes no code."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = ToyTalker(
        ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16), torch.float32, "cuda"
    )

    def cuda_request(length, max_new, seed):
        g = torch.Generator().manual_seed(seed)
        return GenerationInput(
            torch.randn(length, 64, generator=g),
            GREEDY,
            max_new,
            step_rows=torch.randn(3, 64, generator=g),
            pad_embed=torch.randn(64, generator=g),
        )

    stopped, _ = stop_at(model, cuda_request(4, 14, 20), 2)
    arrivals = {
        0: [(f"r{i}", cuda_request(3 + i, 10 + 3 * i, i)) for i in range(5)] + [("stop", stopped)],
        4: [(f"s{i}", cuda_request(5, 8, 10 + i)) for i in range(4)],
    }
    results = both(
        arrivals,
        model,
        kv_cache_bytes=16 << 20,
        max_num_seqs=8,
        max_model_len=256,
        cuda_graph_batch_sizes=(1, 2, 4, 8),
    ).results
    for inputs_list in arrivals.values():
        for request_id, inputs in inputs_list:
            assert torch.equal(
                results[request_id].codes, reference_generate(model, inputs).codes.cpu()
            ), request_id
    assert results["stop"].finish_reason == "stop"
