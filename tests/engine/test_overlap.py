"""The overlapped engine (``EngineConfig.overlap``: step t+1 launched before step t's frames
are read; a prefill step also decodes the running requests, one mixed step with one frame
tail) on the CPU, where it is forced on (the eager path of the mixed step): every request
gets the same frames, token for token, as without overlap and as the unbatched reference
loop, under staggered arrivals, stops at different steps (found one step late), length
stops, aborts and failures mid-run (a newcomer's too), streamed rows, lowered caps, prefix
hits and hidden rows, and nothing is left held afterwards."""

from dataclasses import replace

import pytest
import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.model_runner import StepSampling
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplerFeatures, SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.engine_runs import EngineRun, run_arrivals
from omnistage.testing.host_syncs import no_host_syncs
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


def test_a_prefill_step_is_one_mixed_step_with_the_running_decode_and_one_frame_tail(monkeypatch):
    """A prefill step with running requests runs one frame tail over the decode rows and the
    prefill's last rows (decode first) and goes in flight like a decode step: a newcomer's
    first frame is read in the next step; a prefill with nothing running is read at once."""
    engine = engine_for(True, max_num_seqs=8, max_prefill_tokens=8)
    tails = []
    frame_tail = engine.runner.frame_tail

    def counted_tail(hidden, slot_ids, cache, sampling):
        tails[-1].append(slot_ids.tolist())
        return frame_tail(hidden, slot_ids, cache, sampling)

    monkeypatch.setattr(engine.runner, "frame_tail", counted_tail)
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
        tails.append([])
        outputs = engine.execute(plan)
        z_frames.append(any(o.request_id == "z" and o.frame is not None for o in outputs))
        for out in outputs:
            first_frames.setdefault(out.request_id, step)
        if plan.batch is not None:  # one tail per step, over the decode then the prefill rows
            slots = [s.slot for s in plan.batch.decode + plan.batch.seqs] if plan.batch.kind == "prefill" else [
                s.slot for s in plan.batch.seqs
            ]
            assert tails[-1] == [slots], step
        step += 1
    burst = kinds[2:8]  # six prefills of one request each (5 + 5 tokens > the budget of 8)
    assert [kind for kind, _ in burst] == ["prefill"] * 6
    assert all("z" in decode for _, decode in burst)  # z decodes in every prefill step
    assert burst[1][1] == ["z", "b0"]  # the running ones from before the admission
    assert [len(t[0]) for t in tails[2:8]] == [2, 3, 4, 5, 6, 7]  # B + 1 rows: one tail for both
    # z: frame 0 from its prefill alone (step 0, read at once), frame 1 resolved in step 2,
    # then one every step
    assert first_frames["z"] == 0
    assert z_frames[:2] == [True, False] and all(z_frames[2:31]) and not any(z_frames[31:])
    for i in range(6):  # each newcomer's first frame: from its mixed step, read a step later
        assert first_frames[f"b{i}"] == 3 + i
    assert_nothing_held(engine)


HIDDEN = ToyTalker(ToyARConfig(hidden_layers=(0, 2, 1)), DTYPE)


def test_hidden_rows_in_mixed_steps_equal_the_plain_engine():
    """``return_hidden`` requests prefilled while others decode (a mixed step's decode rows
    and prefill rows) and decoding while others are prefilled: each gets its prompt's rows
    with frame 0, then its fed token's with each frame, as without overlap."""

    def hidden_request(length, max_new, seed, hidden=True):
        return replace(request(length, max_new, seed=seed), return_hidden=hidden)

    arrivals = {
        0: [("h0", hidden_request(4, 9, 1)), ("p0", hidden_request(3, 8, 2, hidden=False))],
        2: [("h1", hidden_request(5, 6, 3))],
        3: [("p1", hidden_request(2, 7, 4, hidden=False)), ("h2", hidden_request(3, 5, 5))],
        5: [("h3", hidden_request(6, 4, 6))],
    }
    runs = []
    for overlap in (False, True):
        engine = engine_for(overlap, HIDDEN, max_prefill_tokens=6)
        runs.append(run_arrivals(engine, arrivals))
        assert_nothing_held(engine)
    assert_same_run(*runs)
    plain, overlapped = runs
    assert set(overlapped.hidden) == {"h0", "h1", "h2", "h3"}
    for inputs_list in arrivals.values():
        for request_id, inputs in inputs_list:
            if not inputs.return_hidden:
                continue
            rows = overlapped.hidden[request_id]
            # length stops: every frame but the last fed its token
            assert [r.shape[0] for r in rows] == [inputs.prompt.shape[0]] + [1] * (inputs.max_new_tokens - 1)
            assert all(r.shape[1:] == (3, 32) for r in rows)
            for got, want in zip(rows, plain.hidden[request_id], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_prefix_hits_in_mixed_steps_equal_the_plain_engine():
    """Known-voice requests (a cached 32-row prefix, then their own rows) arriving one a step
    while others decode: the same prefix hits and frames as without overlap."""
    prefix = torch.randn(32, 32, generator=torch.Generator().manual_seed(8), dtype=DTYPE)

    def voice(seed, max_new):
        given = request(3, max_new, seed=seed)
        return replace(given, prompt=torch.cat([prefix, given.prompt]), cache_prompt=True)

    arrivals = {step: [(f"v{step}", voice(step, 4 + step % 3))] for step in range(7)}
    arrivals[0].append(("long", request(3, 14, seed=99)))
    runs, hits = [], []
    for overlap in (False, True):
        engine = engine_for(overlap, max_num_seqs=6)
        runs.append(run_arrivals(engine, arrivals))
        hits.append(engine.prefix_hit_tokens)
        assert_nothing_held(engine)
    assert_same_run(*runs)
    assert hits[0] == hits[1] == 6 * 32  # every voice after the first reused both blocks
    for step, [(request_id, inputs), *_] in arrivals.items():
        assert torch.equal(runs[1].results[request_id].codes, reference_generate(MULTI, inputs).codes), step


def test_an_abort_while_a_newcomers_mixed_step_is_in_flight_drops_its_first_frame():
    """``n`` is admitted in a mixed step beside ``a``'s decode and aborted before that step's
    frames are read: it gets no frame, ``a`` runs on as the reference, nothing is held."""
    engine = engine_for(True)
    engine.add_request("a", request(3, 8, seed=1))
    engine.step()  # prefill a alone: its frame read at once
    engine.step()  # decode a: in flight
    engine.add_request("n", request(2, 6, seed=2))
    plan = engine.schedule()
    assert plan.batch.kind == "prefill" and [s.request_id for s in plan.batch.decode] == ["a"]
    assert [o.request_id for o in engine.execute(plan)] == ["a"]  # the decode's frame, not n's
    engine.abort("n")
    run = run_arrivals(engine, {})
    assert "n" not in run.frames and "n" not in run.results
    assert torch.equal(run.results["a"].codes, reference_generate(MULTI, request(3, 8, seed=1)).codes)
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
    starts = {"s0": 0, "s1": 2, "s2": 3}  # s1, s2 prefilled in mixed steps beside the decodes
    engine = engine_for(True)
    sent = dict.fromkeys(full, 1)
    results, step = {}, 0
    while engine.has_work() or step <= max(starts.values()):
        for request_id, given in full.items():
            if starts[request_id] == step:
                head = given.step_rows[:1]
                engine.add_request(request_id, GenerationInput(given.prompt, given.sampling, given.max_new_tokens,
                                                               head, given.pad_embed, more_rows=True))  # fmt: skip
        for i, (request_id, given) in enumerate(full.items()):
            if step < starts[request_id]:
                continue
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


@pytest.mark.parametrize("where", ["decode", "mixed step"])
def test_a_failing_step_fails_its_launched_and_in_flight_requests(monkeypatch, where):
    """A decode that raises while a step is in flight (or the decode of a mixed step, after
    its prefill) ends every request of the plan, its in-flight ones included; a waiting one
    runs on."""
    engine = engine_for(True, max_num_seqs=3)
    for name, seed in (("a", 1), ("b", 2)):
        engine.add_request(name, request(3, 8, seed=seed))
    engine.step()  # prefill a, b
    engine.step()  # decode a, b: in flight
    if where == "mixed step":
        engine.add_request("n", request(2, 5, seed=4))
        engine.add_request("w", request(3, 6, seed=3))  # waits for a slot

    def failing_decode(*args, **kwargs):
        raise RuntimeError("device fault")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "decode", failing_decode)
        plan = engine.schedule()
        expected = {"a", "b", "n"} if where == "mixed step" else {"a", "b"}
        assert set(plan.request_ids) == expected
        with pytest.raises(RuntimeError, match="device fault"):
            engine.execute(plan)
    assert engine.live_requests() == ({"w"} if where == "mixed step" else set())
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
    arrivals = {} if where == "mixed step" else {0: [("w", request(3, 6, seed=3))]}
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


def spy_mixed_steps(engine, monkeypatch, mixed, check_syncs):
    """Record ``engine``'s mixed steps in ``mixed``: ``("graphs", B, k)`` for each launched
    (with ``check_syncs``: under :func:`no_host_syncs`), ``("eager", B, k)`` for each that ran
    the eager runner's fused decode."""
    launch, decode = engine._launch, engine.runner.decode

    def checked_launch(batch):
        if batch.kind != "prefill" or not batch.decode or not check_syncs:
            return launch(batch)
        mixed.append(("graphs", len(batch.decode), len(batch.seqs)))
        with no_host_syncs():  # a mixed step replayed: nothing waits for the device
            return launch(batch)

    def eager_decode(meta, cache, width=None, sampling=StepSampling(), extra=None):
        if extra is not None:
            mixed.append(("eager", meta.shape[0], extra[0].shape[0]))
        return decode(meta, cache, width, sampling, extra)

    monkeypatch.setattr(engine, "_launch", checked_launch)
    monkeypatch.setattr(engine.runner, "decode", eager_decode)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("buckets", [(1, 2, 4, 8), (1, 2, 4)], ids=["graphs", "past-the-largest-bucket"])
def test_cuda_mixed_steps_with_graphs_equal_the_eager_engine(monkeypatch, buckets):
    """Mixed steps on CUDA with overlap: with graphs (a feed at the bucket of the B decode
    rows, then one tail at the bucket of B + k: 3 + 2 rows feed at 4 and tail at 8, 1 + 1 at
    1 and 2), a launch that waits for nothing on the host; with the largest bucket below
    B + k, the eager mixed step; the same frames and hidden rows as the eager engine (no
    graphs). fp32 without TF32, so batching changes no code."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = ToyTalker(
        ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, hidden_layers=(0, 2)),
        torch.float32,
        "cuda",
    )

    def cuda_request(length, max_new, seed, hidden=False):
        g = torch.Generator().manual_seed(seed)
        return GenerationInput(
            torch.randn(length, 64, generator=g), GREEDY, max_new,
            step_rows=torch.randn(3, 64, generator=g), pad_embed=torch.randn(64, generator=g),
            return_hidden=hidden,
        )  # fmt: skip

    arrivals = {
        0: [("z", cuda_request(4, 40, 0))] + [(f"r{i}", cuda_request(3 + i, 12, 1 + i)) for i in range(2)],
        2: [("s0", cuda_request(5, 10, 5)), ("s1", cuda_request(2, 9, 6, hidden=True))],  # 3 + 2
        4: [("h0", cuda_request(6, 8, 7, hidden=True))],  # 5 + 1
        5: [("h1", cuda_request(3, 7, 8, hidden=True)), ("t0", cuda_request(4, 6, 9))],  # 6 + 2
        30: [("late", cuda_request(5, 6, 10, hidden=True))],  # 1 + 1 (z alone decodes)
    }
    greedy = SamplerFeatures.of([GREEDY])
    config = dict(kv_cache_bytes=16 << 20, max_num_seqs=8, max_model_len=256, graph_sampling=(StepSampling(greedy, greedy),))
    runs, mixed = [], []
    for graphs in (False, True):
        engine = engine_for(True, model, **config, cuda_graph_batch_sizes=buckets if graphs else (),
                            cuda_graph_prefill_tokens=None if graphs else ())  # fmt: skip
        assert (engine.graphs is not None) is graphs
        if graphs:
            spy_mixed_steps(engine, monkeypatch, mixed, check_syncs=len(buckets) == 4)
        runs.append(run_arrivals(engine, arrivals))
        assert_nothing_held(engine)
    assert_same_run(*runs)
    eager, replayed = runs
    if len(buckets) == 4:
        assert {(3, 2), (5, 1), (6, 2), (1, 1)} <= {(b, k) for path, b, k in mixed if path == "graphs"}
        assert all(path == "graphs" for path, _, _ in mixed)
    else:  # past the largest bucket: eager; within it: replayed (not seen by the spy)
        assert {(3, 2), (5, 1), (6, 2)} <= {(b, k) for path, b, k in mixed if path == "eager"}
        assert (1, 1) not in {(b, k) for _, b, k in mixed}
    assert set(replayed.hidden) == {"s1", "h0", "h1", "late"}
    for request_id, rows in replayed.hidden.items():
        assert len(rows) == len(eager.hidden[request_id]), request_id
        for got, want in zip(rows, eager.hidden[request_id], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for inputs_list in arrivals.values():
        for request_id, inputs in inputs_list:
            assert torch.equal(replayed.results[request_id].codes, reference_generate(model, inputs).codes.cpu()), (
                request_id
            )
