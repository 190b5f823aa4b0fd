"""Step rows streamed into running requests: a request admitted with part of its rows
waits (out of the batch, never padded) until its next row arrives, never holds back the
others, and samples exactly as if every row had been there from the start."""

import random

import pytest
import torch

from omnistage.core.errors import RequestValidationError
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker
from omnistage.testing.waits import thread_stacks

DTYPE = torch.float64
MULTI = ToyTalker(ToyARConfig(), DTYPE)
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=7)


def whole(length, max_new, rows, seed, sampling=GREEDY, predictor=None, hidden=32, dtype=DTYPE):
    """A request with all its ``rows`` step rows given at once."""
    g = torch.Generator().manual_seed(seed)
    return GenerationInput(
        torch.randn(length, hidden, generator=g, dtype=dtype), sampling, max_new,
        step_rows=torch.randn(rows, hidden, generator=g, dtype=dtype),
        pad_embed=torch.randn(hidden, generator=g, dtype=dtype), predictor_sampling=predictor,
    )


def streamed(inputs, given):
    """The same request with only its first ``given`` rows at admission."""
    head = inputs.step_rows[:given] if given else None
    return GenerationInput(inputs.prompt, inputs.sampling, inputs.max_new_tokens, step_rows=head,
                           pad_embed=inputs.pad_embed, predictor_sampling=inputs.predictor_sampling, more_rows=True)


def engine_for(**overrides):
    config = dict(kv_cache_bytes=1 << 20, max_model_len=128, prefill_hold_ms=0.0, max_num_seqs=4, num_step_rows=512)
    return AREngine(MULTI, EngineConfig(**(config | overrides)))


def drain(engine, results, frames, feed=lambda step: None, max_steps=500):
    for step in range(max_steps):
        if not engine.has_work():
            return
        feed(step)
        for out in engine.step():
            if out.frame is not None:
                frames.setdefault(out.request_id, []).append(out.frame)
            if out.result is not None:
                results[out.request_id] = out.result
    raise AssertionError("the engine did not finish")


def assert_nothing_held(engine):
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
    assert engine.row_blocks.num_free_blocks == engine.row_blocks.num_blocks
    assert not engine.live_requests() and not engine.has_work()


@pytest.mark.parametrize(
    ("sampling", "predictor"), [(GREEDY, None), (SAMPLED, SamplingParams(temperature=0.9, top_k=5, seed=8))],
    ids=["greedy", "seeded"],
)
def test_rows_fed_one_by_one_with_random_gaps_equal_all_rows_at_once(sampling, predictor):
    """Three requests get their rows one at a time, each step or after gaps of a few steps,
    while a fourth has all its rows; each equals the reference with every row given."""
    full = {f"s{i}": whole(3 + i, 14, rows=6 + 2 * i, seed=i, sampling=sampling, predictor=predictor)
            for i in range(3)}
    full["w"] = whole(4, 12, rows=3, seed=9, sampling=sampling, predictor=predictor)
    assert_random_gaps_equal_all_at_once(MULTI, engine_for(), full, {"s0": 0, "s1": 1, "s2": 3})


def assert_random_gaps_equal_all_at_once(model, engine, full, given):
    """Add ``full`` (streamed with only ``given`` rows for the ids in it), feed the other
    rows one at a time with random gaps, and compare with the reference loop."""
    rng = random.Random(0)
    for request_id, inputs in full.items():
        engine.add_request(request_id, streamed(inputs, given[request_id]) if request_id in given else inputs)
    fed = dict(given)
    waited = set()

    def feed(step):
        for request_id, count in fed.items():
            seq = engine.scheduler.get(request_id)
            if seq is not None and not seq.schedulable and seq.status.value == "running":
                waited.add(request_id)
            rows = full[request_id].step_rows
            if count < rows.shape[0] and rng.random() < 0.4:
                engine.append_step_rows(request_id, rows[count : count + 1])
                fed[request_id] = count + 1
                if count + 1 == rows.shape[0]:
                    engine.complete_step_rows(request_id)

    results, frames = {}, {}
    drain(engine, results, frames, feed)
    assert waited == set(given)  # every streamed request really waited for a row
    for request_id, inputs in full.items():
        codes, reason = (ref := reference_generate(model, inputs)).codes, ref.finish_reason
        assert results[request_id].finish_reason == reason
        assert torch.equal(results[request_id].codes.cpu(), codes.cpu()), request_id
        assert torch.equal(torch.cat(frames[request_id]).cpu(), codes.cpu())
    assert_nothing_held(engine)


def test_a_request_waiting_for_its_row_does_not_hold_back_the_others():
    slow, other = whole(3, 10, rows=4, seed=1), whole(5, 8, rows=2, seed=2)
    engine = engine_for()
    engine.add_request("slow", streamed(slow, 1))
    engine.add_request("other", other)
    results, frames = {}, {}
    for _ in range(9):  # prefill, then "other"'s 7 decode steps (and one idle)
        for out in engine.step():
            if out.frame is not None:
                frames.setdefault(out.request_id, []).append(out.frame)
            if out.result is not None:
                results[out.request_id] = out.result
    assert torch.equal(results["other"].codes, reference_generate(MULTI, other).codes)
    # "slow" fed row 0 (frame 0 -> frame 1), then waited for row 1: it was never padded
    assert len(frames["slow"]) == 2 and engine.scheduler.get("slow").num_scheduled == 2
    assert engine.wait_hint() is None  # nothing to do until a row arrives: no busy loop
    engine.append_step_rows("slow", slow.step_rows[1:])
    engine.complete_step_rows("slow")
    assert engine.wait_hint() == 0.0
    drain(engine, results, frames)
    assert torch.equal(results["slow"].codes, reference_generate(MULTI, slow).codes)
    assert_nothing_held(engine)


def test_rows_appended_before_admission_are_used():
    first, later = whole(3, 6, rows=1, seed=3), whole(4, 9, rows=5, seed=4)
    engine = engine_for(max_num_seqs=1)
    engine.add_request("first", first)
    engine.add_request("later", streamed(later, 0))
    engine.append_step_rows("later", later.step_rows[:2])  # "later" waits for the slot
    assert engine.scheduler.get("later").status.value == "waiting"
    engine.append_step_rows("later", later.step_rows[2:])
    engine.complete_step_rows("later")
    results, frames = {}, {}
    drain(engine, results, frames)
    assert torch.equal(results["later"].codes, reference_generate(MULTI, later).codes)
    assert_nothing_held(engine)


def test_rows_past_the_frames_are_dropped_and_completing_early_pads_from_there():
    inputs = whole(3, 5, rows=4, seed=5)  # 5 frames feed back 4 rows
    engine = engine_for()
    engine.add_request("r", streamed(inputs, 0))
    assert engine.scheduler.get("r").inputs.num_step_rows == 5  # 4 rows + the pad row
    engine.append_step_rows("r", torch.cat([inputs.step_rows, torch.randn(3, 32, dtype=DTYPE)]))
    engine.complete_step_rows("r")
    results = {}
    drain(engine, results, {})
    assert torch.equal(results["r"].codes, reference_generate(MULTI, inputs).codes)
    padded = whole(3, 8, rows=2, seed=6)
    engine.add_request("p", streamed(padded, 2))
    engine.complete_step_rows("p")  # no more rows: frames 2.. take the pad row
    drain(engine, results, {})
    assert torch.equal(results["p"].codes, reference_generate(MULTI, padded).codes)
    assert_nothing_held(engine)


def test_abort_while_waiting_for_a_row_frees_everything():
    engine = engine_for()
    engine.add_request("r", streamed(whole(3, 40, rows=4, seed=7), 1))
    for _ in range(4):
        engine.step()
    assert not engine.scheduler.get("r").schedulable
    engine.abort("r")
    assert_nothing_held(engine)
    assert engine.append_step_rows("r", torch.zeros(1, 32)) is False  # late rows are dropped
    assert engine.complete_step_rows("r") is False


def test_bad_row_appends_are_refused():
    engine = engine_for()
    engine.add_request("plain", whole(3, 4, rows=1, seed=8))
    engine.add_request("s", streamed(whole(3, 4, rows=1, seed=8), 0))
    with pytest.raises(ValueError, match="no more step rows"):
        engine.append_step_rows("plain", torch.zeros(1, 32))
    with pytest.raises(RequestValidationError, match=r"\[K, 32\]"):
        engine.append_step_rows("s", torch.zeros(1, 16))
    with pytest.raises(RequestValidationError, match=r"\[K, 32\]"):
        engine.append_step_rows("s", torch.zeros(1, 32, dtype=torch.int64))
    engine.complete_step_rows("s")
    with pytest.raises(ValueError, match="no more step rows"):
        engine.append_step_rows("s", torch.zeros(1, 32))
    drain(engine, {}, {})
    assert_nothing_held(engine)


def test_a_streamed_request_reserves_a_row_per_frame_and_is_refused_if_the_pool_is_smaller():
    engine = engine_for(num_step_rows=32)
    with pytest.raises(RequestValidationError, match="step rows exceed the pool"):
        engine.add_request("big", streamed(whole(3, 60, rows=1, seed=9), 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_and_overlap_with_waiting_requests_equal_the_reference(monkeypatch):
    """Parked requests make smaller batches (other CUDA-graph buckets); the host resolves
    step t while step t+1 runs, and rows land while a step is in flight."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = ToyTalker(ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16), torch.float32, "cuda")
    engine = AREngine(model, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=8, max_model_len=256,
                                          prefill_hold_ms=0.0, num_step_rows=1024,
                                          cuda_graph_batch_sizes=(1, 2, 4, 8)))
    assert engine.graphs is not None and engine.overlap
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=11)
    full = {f"r{i}": whole(3 + i, 16, rows=5 + i, seed=20 + i, hidden=64, dtype=torch.float32,
                           sampling=sampled if i % 2 else GREEDY) for i in range(6)}
    assert_random_gaps_equal_all_at_once(model, engine, full, {"r0": 0, "r1": 1, "r2": 2, "r3": 0})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("own_stream", [False, True], ids=["one_stream", "own_streams"])
@pytest.mark.parametrize("built_here", [False, True], ids=["built_by_their_threads", "built_here"])
def test_two_engines_on_two_threads_with_rows_made_on_the_device_equal_the_reference(
    monkeypatch, own_stream, built_here
):
    """Two engines of one process, each driven by its own thread (the Qwen3-Omni thinker and
    talker), with step rows made on the device by the feeding thread just before they are
    appended (fresh tensors, dropped once appended: the allocator may hand their memory out
    again), on the caller's stream or each engine on its own (``own_stream``): every request
    equals the reference loop. Built by their threads, the engines capture their graphs at
    once (one capture at a time in the process); built here, one thread captured all of them
    before either runs, as a pipeline's start-up does."""
    import threading

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = ToyTalker(ToyARConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16), torch.float32, "cuda")
    failures: list[BaseException] = []

    def build() -> AREngine:
        return AREngine(model, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=8, max_model_len=256,
                                            prefill_hold_ms=0.0, num_step_rows=1024, own_stream=own_stream))

    engines = {name: build() for name in ("a", "b")} if built_here else {}

    def drive(name: str) -> None:
        try:
            engine = engines[name] if built_here else build()
            assert (engine.stream is not None) == own_stream
            full = {f"{name}{i}": whole(3 + i, 16, rows=5 + i, seed=40 + i, hidden=64, dtype=torch.float32) for i in range(4)}
            device_rows = {rid: inputs.step_rows.to("cuda") for rid, inputs in full.items()}
            for rid, inputs in full.items():
                engine.add_request(rid, streamed(inputs, 0))
            fed = dict.fromkeys(full, 0)
            results, frames = {}, {}

            def feed(step: int) -> None:
                for rid, count in fed.items():
                    if count < device_rows[rid].shape[0]:
                        # a fresh device tensor on this thread's stream, dropped once appended
                        engine.append_step_rows(rid, device_rows[rid][count : count + 1] * 1.0)
                        fed[rid] = count + 1
                        if count + 1 == device_rows[rid].shape[0]:
                            engine.complete_step_rows(rid)

            drain(engine, results, frames, feed)
            for rid, inputs in full.items():
                assert torch.equal(results[rid].codes.cpu(), reference_generate(model, inputs).codes.cpu()), rid
        except BaseException as exc:  # noqa: BLE001 -- reported to the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=drive, args=(name,), daemon=True) for name in ("a", "b")]  # a hung one: no join at exit
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if any(thread.is_alive() for thread in threads):
        pytest.fail(f"an engine thread did not finish within 120 s; thread stacks:\n{thread_stacks()}")
    assert not failures, failures


def test_own_stream_is_off_by_default_and_ignored_on_the_cpu():
    """``own_stream`` asks for a CUDA stream of the engine's own: off unless asked, and on
    the CPU there is no stream to take, so the engine runs as without it."""
    assert EngineConfig().own_stream is False
    engine = engine_for(own_stream=True)
    assert engine.stream is None
    inputs = whole(5, 8, rows=3, seed=5)
    results, frames = {}, {}
    engine.add_request("r", streamed(inputs, 1))
    engine.append_step_rows("r", inputs.step_rows[1:])
    engine.complete_step_rows("r")
    drain(engine, results, frames)
    assert torch.equal(results["r"].codes, reference_generate(MULTI, inputs).codes)
    assert_nothing_held(engine)


def run_capped(inputs, lowered_at: int, cap: int) -> tuple[list[torch.Tensor], str]:
    """Run ``inputs`` alone, lowering its cap to ``cap`` once it made ``lowered_at`` frames."""
    engine, results, frames, lowered = engine_for(), {}, {}, []

    def feed(step):
        if not lowered and len(frames.get("r", [])) == lowered_at:
            lowered.append(engine.cap_new_tokens("r", cap))

    engine.add_request("r", inputs)
    drain(engine, results, frames, feed)
    assert lowered == [True] and engine.cap_new_tokens("r", 3) is False  # it ended: gone
    assert_nothing_held(engine)
    return frames["r"], results["r"].finish_reason


def test_a_cap_lowered_while_running_ends_the_request_there_with_length():
    """``cap_new_tokens`` after some frames: the request ends at the new cap with the first
    frames of the uncapped run; a cap below what it made ends it after one more frame."""
    inputs = whole(5, 40, 3, seed=11)
    uncapped = reference_generate(MULTI, inputs).codes
    for lowered_at, cap, expected in ((3, 10, 10), (6, 2, 7)):
        frames, reason = run_capped(inputs, lowered_at, cap)
        assert reason == "length"
        torch.testing.assert_close(torch.cat(frames), uncapped[:expected], rtol=0, atol=0)
