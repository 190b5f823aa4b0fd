"""The AR engine as a pipeline stage: frames stream to the next stage as they are made,
results carry finish_reason, aborts free KV blocks at once, nothing is left behind."""

import asyncio
from dataclasses import replace

import pytest
import torch

from omnistage.core.errors import RequestAbortedError, RequestValidationError
from omnistage.core.messages import StreamBatch, StreamChunk
from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.pipeline.pipeline import Pipeline
from omnistage.scheduling.ar import CodeFrames, FrameWithHidden
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.toy_ar_stage import (
    ROW_GATES,
    ToyARRequest,
    ar_pipeline_config,
    ar_stream_pipeline_config,
    toy_ar_input,
    toy_ar_model,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine_of(pipeline):
    return pipeline.host.stages["engine"].scheduler.engine


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_concurrent_requests_stream_every_frame_and_match_the_reference(overlap):
    requests = [ToyARRequest(3 + i, 6 + 3 * i, seed=i) for i in range(6)]  # more than the 4 slots
    model = toy_ar_model()
    async with Pipeline(ar_pipeline_config(overlap=overlap)) as pipeline:
        assert engine_of(pipeline).overlap is overlap
        handles = [pipeline.submit(r) for r in requests]
        results = await asyncio.gather(*(h.result() for h in handles))
        for request, result in zip(requests, results, strict=True):
            streamed, summary = result.outputs["collect"]
            expected, reason = (ref := reference_generate(model, toy_ar_input(request))).codes, ref.finish_reason
            assert result.finish_reason == reason == "length"
            assert torch.equal(streamed, expected) and summary.num_frames == expected.shape[0]
            client_frames = torch.cat([chunk.data.codes for chunk in result.chunks])
            assert torch.equal(client_frames, expected)
        await assert_no_request_state(pipeline)
        engine = engine_of(pipeline)
        assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_a_plain_token_lm_stage_streams_one_token_per_step_and_stops_on_a_stop_id(overlap):
    model = toy_ar_model(num_code_groups=1)
    sampling = SamplingParams(temperature=0.7, top_k=10, top_p=0.95, repetition_penalty=1.2, seed=4)
    plain = ToyARRequest(6, 20, seed=50, sampling=sampling, token_ids=True)
    stop = int(reference_generate(model, toy_ar_input(plain)).codes[5, 0])
    requests = [replace(plain, sampling=replace(sampling, stop_token_ids=(stop,)))]
    requests += [ToyARRequest(3 + i, 7, seed=51 + i, sampling=replace(sampling, seed=i), token_ids=True)
                 for i in range(3)]
    async with Pipeline(ar_pipeline_config(num_code_groups=1, overlap=overlap)) as pipeline:
        results = await asyncio.gather(*(pipeline.submit(r).result() for r in requests))
        for request, result in zip(requests, results, strict=True):
            expected, reason = (ref := reference_generate(model, toy_ar_input(request))).codes, ref.finish_reason
            streamed, generated = result.outputs["collect"]
            assert result.finish_reason == reason and generated.num_frames == streamed.shape[0]
            assert torch.equal(streamed, expected) and expected.shape[1] == 1
            assert all(chunk.data.codes.shape == (1, 1) for chunk in result.chunks)  # one token per step
        assert results[0].finish_reason == "stop" and stop not in results[0].outputs["collect"][0]
        await assert_no_request_state(pipeline)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_hidden_rows_stream_out_with_each_token_of_the_requests_that_ask(overlap):
    model = toy_ar_model(num_code_groups=1, hidden_layers=(0, 2))
    plain = ToyARRequest(5, 6, seed=60, token_ids=True)
    asking = replace(plain, seed=61, return_hidden=True)
    async with Pipeline(ar_pipeline_config(num_code_groups=1, hidden_layers=[0, 2], overlap=overlap)) as pipeline:
        without, with_rows = await asyncio.gather(*(pipeline.submit(r).result() for r in (plain, asking)))
        assert all(isinstance(chunk.data, CodeFrames) for chunk in without.chunks)
        chunks = [chunk.data for chunk in with_rows.chunks]
        assert all(isinstance(c, FrameWithHidden) and c.hidden.shape[1:] == (2, 32) for c in chunks)
        assert [c.hidden.shape[0] for c in chunks] == [5] + [1] * 5  # the prompt, then one token a step
        expected = reference_generate(model, toy_ar_input(asking)).codes
        assert torch.equal(torch.cat([c.frame for c in chunks]), expected)
        inputs = toy_ar_input(asking)
        assert torch.equal(chunks[0].hidden[:, 0], model.embed_tokens(inputs.prompt))  # layer 0: the embeddings
        fed = model.next_input_embeds(expected[:1], inputs.step_rows[:1])  # token 0 + row 0, fed at step 1
        assert torch.equal(chunks[1].hidden[:, 0], fed)
        await assert_no_request_state(pipeline)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_abort_mid_decode_frees_the_kv_blocks_at_once(overlap):
    async with Pipeline(ar_pipeline_config(overlap=overlap)) as pipeline:
        engine = engine_of(pipeline)
        assert engine.overlap is overlap
        handle = pipeline.submit(ToyARRequest(4, 900))
        stream = handle.stream()
        await anext(stream)  # decoding has started
        pipeline.abort(handle.request_id)
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        await assert_no_request_state(pipeline)
        assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
        after = await pipeline.submit(ToyARRequest(2, 3, seed=5)).result()
        assert after.finish_reason == "length"


async def test_a_request_that_cannot_fit_fails_with_a_typed_error():
    async with Pipeline(ar_pipeline_config()) as pipeline:
        with pytest.raises(RequestValidationError, match="max_model_len"):
            await pipeline.submit(ToyARRequest(200, 900)).result()
        await assert_no_request_state(pipeline)


# ------------------------------------------------------- rows streamed into running requests
def expected_codes(request):
    ref = reference_generate(toy_ar_model(), toy_ar_input(request))
    return ref.codes, ref.finish_reason


@pytest.mark.parametrize("start_in_payload", [False, True], ids=["start-chunk", "start-payload"])
async def test_rows_streamed_in_by_another_stage_equal_all_rows_at_once(start_in_payload):
    requests = [ToyARRequest(3 + i, 8 + 2 * i, seed=100 + i, rows=5 + i, given=i % 2) for i in range(5)]
    requests.append(ToyARRequest(4, 3, seed=110, rows=9))  # ends by length before its rows do
    async with Pipeline(ar_stream_pipeline_config(start_in_payload)) as pipeline:
        results = await asyncio.gather(*(pipeline.submit(r).result() for r in requests))
        for request, result in zip(requests, results, strict=True):
            streamed, generated = result.outputs["collect"]
            expected, reason = expected_codes(request)
            assert result.finish_reason == reason == "length" and generated.num_frames == streamed.shape[0]
            assert torch.equal(streamed, expected) and torch.equal(streamed, expected)
        await assert_no_request_state(pipeline)


async def test_a_request_waiting_for_streamed_rows_does_not_hold_back_the_others():
    slow = ToyARRequest(3, 12, seed=120, rows=6, given=1, gated=True)
    fast = ToyARRequest(4, 10, seed=121, rows=3)
    async with Pipeline(ar_stream_pipeline_config()) as pipeline:
        engine = engine_of(pipeline)
        slow_handle = pipeline.submit(slow)
        slow_frames = slow_handle.stream()
        for _ in range(2):  # frame 0 (prefill) and frame 1 (fed row 0): then it needs row 1
            await anext(slow_frames)
        fast_result = await pipeline.submit(fast).result()
        assert torch.equal(fast_result.outputs["collect"][0], expected_codes(fast)[0])
        waiting = engine.scheduler.get(slow_handle.request_id)
        assert waiting.num_scheduled == 2 and not waiting.schedulable  # it waited, unpadded
        ROW_GATES.allow(slow.seed, 5)
        frames = [chunk.data.codes async for chunk in slow_frames]
        assert torch.equal(torch.cat(frames), expected_codes(slow)[0][2:])
        await assert_no_request_state(pipeline)


async def test_abort_while_waiting_for_streamed_rows_frees_everything():
    stuck = ToyARRequest(3, 30, seed=130, rows=8, given=1, gated=True)
    async with Pipeline(ar_stream_pipeline_config()) as pipeline:
        engine = engine_of(pipeline)
        handle = pipeline.submit(stuck)
        stream = handle.stream()
        for _ in range(2):
            await anext(stream)
        pipeline.abort(handle.request_id)
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        ROW_GATES.allow(stuck.seed, 7)  # the feeder's rows now land on a tombstone
        await assert_no_request_state(pipeline)
        assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks
        assert engine.row_blocks.num_free_blocks == engine.row_blocks.num_blocks


async def until(condition, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_a_request_done_before_its_payload_arrived_ends_once_it_does():
    short = ToyARRequest(4, 2, seed=140, rows=5, given=1, gated=True)  # 2 frames need only row 0
    async with Pipeline(ar_stream_pipeline_config()) as pipeline:
        scheduler = pipeline.host.stages["engine"].scheduler
        handle = pipeline.submit(short)
        await until(lambda: handle.request_id in scheduler.live_requests())
        await until(lambda: handle.request_id not in scheduler.engine.live_requests())
        assert handle.request_id in scheduler.live_requests()  # its result waits for the payload
        ROW_GATES.allow(short.seed, 4)
        result = await handle.result()
        streamed, generated = result.outputs["collect"]
        assert result.finish_reason == "length" and torch.equal(streamed, expected_codes(short)[0])
async def test_a_step_streams_every_requests_frame_in_one_message_per_target():
    """The engine's frames of one step travel as one StreamBatch to its stream target,
    never as one message per request; the client still gets every frame, in order."""
    requests = [ToyARRequest(3 + i, 5, seed=i) for i in range(4)]
    model = toy_ar_model()
    async with Pipeline(ar_pipeline_config()) as pipeline:
        sent: list[object] = []
        send = pipeline.host.send

        def counting_send(target, message, source):
            if source == "engine":
                sent.append(message)
            send(target, message, source)

        pipeline.host.send = counting_send
        handles = [pipeline.submit(r) for r in requests]
        results = await asyncio.gather(*(h.result() for h in handles))
        for request, result in zip(requests, results, strict=True):
            expected = reference_generate(model, toy_ar_input(request)).codes
            assert torch.equal(torch.cat([chunk.data.codes for chunk in result.chunks]), expected)
        assert not [m for m in sent if isinstance(m, StreamChunk)]
        batches = [m for m in sent if isinstance(m, StreamBatch)]
        assert sum(len(b.chunks) for b in batches) == 4 * 5
        assert max(len(b.chunks) for b in batches) == 4  # a step of all four requests
        await assert_no_request_state(pipeline)


async def test_frames_stream_across_processes_in_batches_and_match_the_reference():
    """The engine in its own process: its step batches travel through the transport (host
    frames, by value) and every request still gets exactly the reference frames."""
    requests = [ToyARRequest(3 + i, 4 + 2 * i, seed=i) for i in range(6)]
    model = toy_ar_model()
    async with Pipeline(ar_pipeline_config(engine_process="engine")) as pipeline:
        handles = [pipeline.submit(r) for r in requests]
        results = await asyncio.gather(*(h.result() for h in handles))
        for request, result in zip(requests, results, strict=True):
            streamed, generated = result.outputs["collect"]
            expected, reason = (ref := reference_generate(model, toy_ar_input(request))).codes, ref.finish_reason
            assert torch.equal(streamed, expected) and torch.equal(streamed, expected)
            assert result.finish_reason == reason
        await assert_no_request_state(pipeline)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_each_engine_step_reaches_the_batch_observer_with_its_kind(overlap):
    # six requests on four slots: the last two are admitted while others still decode
    requests = [ToyARRequest(3 + i, 6 + 3 * i, seed=i) for i in range(6)]
    async with Pipeline(ar_pipeline_config(overlap=overlap)) as pipeline:
        steps: list[tuple[int, str]] = []
        pipeline.host.stages["engine"].scheduler.batch_observer = lambda size, seconds, kind: steps.append((size, kind))
        await asyncio.gather(*(pipeline.submit(r).result() for r in requests))
    kinds = [kind for _, kind in steps]
    if overlap:  # admissions join a decode; the last step only waits for the one in flight
        assert "mixed" in kinds and kinds[-1] == "drain"
        assert set(kinds) <= {"prefill", "mixed", "decode", "drain"}
    else:  # each request is prefilled once, and a decode holds at most the four slots
        assert set(kinds) == {"prefill", "decode"}
        assert sum(size for size, kind in steps if kind == "prefill") == len(requests)
        assert max(size for size, kind in steps if kind == "decode") == 4
    # one frame per request per step: the longest request alone takes that many steps
    assert len(steps) >= max(r.max_new_tokens for r in requests)
