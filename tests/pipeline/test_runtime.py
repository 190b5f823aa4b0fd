"""The runtime end to end with toy stages, in one process and across processes."""

import asyncio
import random
import time

import pytest

from omnistage.core.errors import (
    PipelineUnhealthyError,
    QueueFullError,
    RequestTimeoutError,
    StageFailureError,
    StreamBufferFullError,
)
from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing import toy
from omnistage.testing.leaks import assert_no_request_state
from tests.pipeline.conftest import LINEAR_PROCESSES, linear_pipeline, omni_pipeline

pytestmark = pytest.mark.anyio


async def run(pipeline: Pipeline, request: toy.ToyRequest):
    handle = pipeline.submit(request)
    chunks = [chunk.data.tolist() async for chunk in handle.stream()]
    return chunks, await handle.result()


async def test_linear_pipeline_streams_exact_outputs(placement):
    texts = ["hello world", "a", "streaming edge!", "x" * 50]
    async with linear_pipeline(placement) as pipeline:
        results = await asyncio.gather(*(run(pipeline, toy.ToyRequest(t)) for t in texts))
        for text, (chunks, result) in zip(texts, results, strict=True):
            expected_chunks, expected_total = toy.expected_linear(text)
            assert chunks == expected_chunks
            assert result.outputs == {"accumulate": expected_total}
            assert result.finish_reason == "stop"
        await assert_no_request_state(pipeline)


async def test_a_client_that_comes_late_takes_every_ready_chunk_as_one_list():
    async with linear_pipeline("in_process") as pipeline:
        handle = pipeline.submit(toy.ToyRequest("hello world"))
        await handle.wait_finished()
        lists = [[chunk.data.tolist() for chunk in chunks] async for chunks in handle.stream_ready()]
        expected_chunks, _ = toy.expected_linear("hello world")
        assert len(expected_chunks) > 1
        assert lists == [expected_chunks]
        assert (await handle.result()).chunks == []
        await assert_no_request_state(pipeline)


async def test_omni_topology_serves_1000_mixed_requests_with_their_terminal_sets(placement):
    rng = random.Random(0)
    requests = [
        toy.ToyRequest(
            "".join(rng.choice("abcdef") for _ in range(rng.randint(1, 7))),
            image=rng.random() < 0.5,
            audio_in=rng.random() < 0.5,
            audio_out=rng.random() < 0.5,
        )
        for _ in range(1000)
    ]
    limit = asyncio.Semaphore(48)

    async def one(request):
        async with limit:
            return await run(pipeline, request)

    async with omni_pipeline(placement) as pipeline:
        results = await asyncio.gather(*(one(r) for r in requests))
        for request, (chunks, result) in zip(requests, results, strict=True):
            expected_outputs, expected_chunks = toy.expected_omni(request)
            assert set(result.outputs) == ({"decode", "code2wav"} if request.audio_out else {"decode"})
            assert result.outputs == expected_outputs
            assert chunks == expected_chunks
        await assert_no_request_state(pipeline)


async def test_stage_failure_fails_only_its_batch_and_serving_goes_on(placement):
    async with linear_pipeline(placement) as pipeline:
        for text, cause in [("FAIL", "RuntimeError: toy failure"), ("OOM now", "OutOfMemoryError")]:
            with pytest.raises(StageFailureError) as info:
                await pipeline.submit(toy.ToyRequest(text)).result()
            assert info.value.stage == "double" and cause in info.value.cause
        item = pipeline.submit(toy.ToyRequest("BADITEM"))
        good = pipeline.submit(toy.ToyRequest("good"))
        with pytest.raises(StageFailureError, match="bad item"):
            await item.result()
        assert (await good.result()).outputs == {"accumulate": toy.expected_linear("good")[1]}
        chunks, result = await run(pipeline, toy.ToyRequest("after"))
        assert chunks == toy.expected_linear("after")[0]
        await assert_no_request_state(pipeline)


async def test_large_tensors_cross_processes_through_shared_memory():
    text = "tensor" * 4000  # 24,000 codes: int64 tensors of 192 KB, above the inline limit
    async with linear_pipeline("multi_process") as pipeline:
        chunks, result = await run(pipeline, toy.ToyRequest(text))
        expected_chunks, expected_total = toy.expected_linear(text)
        assert result.outputs == {"accumulate": expected_total} and chunks == expected_chunks
        await assert_no_request_state(pipeline)  # includes: no shared-memory segment left


async def test_killed_stage_process_fails_its_requests_in_bounded_time():
    async with linear_pipeline("multi_process", process_death_timeout_s=1.0) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("slow", delay_s=30.0))
        deadline = time.monotonic() + 30
        while not any(k.startswith("engine.") for k in await pipeline.live_state()):  # it reached the engine
            assert time.monotonic() < deadline, "the request never reached the engine process"
            await asyncio.sleep(0.01)
        pipeline.processes["engine"].kill()
        start = time.monotonic()
        with pytest.raises(PipelineUnhealthyError, match="engine"):
            await asyncio.wait_for(handle.result(), 5.0)
        assert time.monotonic() - start < 2.0
        assert not pipeline.healthy
        with pytest.raises(PipelineUnhealthyError):
            pipeline.submit(toy.ToyRequest("next"))


async def test_admission_is_bounded():
    toy.GATES.close("encode:hold")
    async with Pipeline(toy.linear_config(max_concurrent_requests=2)) as pipeline:
        first = pipeline.submit(toy.ToyRequest("hold"))
        second = pipeline.submit(toy.ToyRequest("b"))
        with pytest.raises(QueueFullError):
            pipeline.submit(toy.ToyRequest("c"))
        await second.result()
        third = pipeline.submit(toy.ToyRequest("c"))
        toy.GATES.open("encode:hold")
        await asyncio.gather(first.result(), third.result())
        await assert_no_request_state(pipeline)


async def test_deadline_fails_the_request_and_clears_it():
    async with Pipeline(toy.linear_config(request_timeout_s=0.2)) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("late", delay_s=1.0))
        with pytest.raises(RequestTimeoutError):
            await handle.result()
        await assert_no_request_state(pipeline)


async def test_stream_byte_cap_fails_a_request_whose_client_does_not_read():
    async with Pipeline(toy.linear_config(stream_queue_max_bytes=64)) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("a long text that streams many chunks"))
        with pytest.raises(StreamBufferFullError):
            await handle.result()
        await assert_no_request_state(pipeline)


async def test_stream_before_payload_fails_clearly_when_not_declared():
    config = toy.linear_config()
    config.stages[2].can_accept_stream_before_payload = False
    async with Pipeline(config) as pipeline:
        with pytest.raises(StageFailureError, match="arrived before the payload"):
            await pipeline.submit(toy.ToyRequest("abc")).result()
        await assert_no_request_state(pipeline)


async def test_route_outside_next_fails_the_request_with_the_hook_named():
    config = toy.linear_config()
    config.stages[0].route_fn = "omnistage.testing.toy:route_nowhere"
    async with Pipeline(config) as pipeline:
        with pytest.raises(StageFailureError) as info:
            await pipeline.submit(toy.ToyRequest("abc")).result()
        assert info.value.stage == "encode" and "route_fn returned ['nowhere']" in info.value.cause
        await assert_no_request_state(pipeline)


async def test_threaded_stage_lets_downstream_batch():
    toy.BATCH_SIZES.clear()
    async with omni_pipeline("in_process") as pipeline:
        await asyncio.gather(*(run(pipeline, toy.ToyRequest("abc", delay_s=0.05)) for _ in range(16)))
    assert max(toy.BATCH_SIZES) > 1


async def test_random_aborts_under_concurrency_leave_nothing_behind(placement):
    rng = random.Random(1)
    async with omni_pipeline(placement, max_concurrent_requests=256) as pipeline:
        handles = [
            pipeline.submit(toy.ToyRequest("abcdefgh"[: rng.randint(1, 8)], image=rng.random() < 0.5,
                                           audio_out=rng.random() < 0.7, delay_s=rng.random() * 0.01))
            for _ in range(200)
        ]
        aborted = set()
        for handle in rng.sample(handles, 80):
            await asyncio.sleep(rng.random() * 0.002)
            pipeline.abort(handle.request_id)
            pipeline.abort(handle.request_id)  # idempotent
            aborted.add(handle.request_id)
        start = time.monotonic()
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(h.result() for h in handles), return_exceptions=True), 60.0
        )
        assert time.monotonic() - start < 60.0
        for handle, outcome in zip(handles, outcomes, strict=True):
            if handle.request_id not in aborted:
                assert not isinstance(outcome, BaseException), outcome
        await assert_no_request_state(pipeline)


async def test_client_input_needs_a_stage_that_takes_it():
    from omnistage.core.errors import RequestValidationError
    from omnistage.core.payloads import InputText

    async with linear_pipeline("in_process") as pipeline:
        handle = pipeline.submit(toy.ToyRequest("abc"))
        with pytest.raises(RequestValidationError, match="takes no input while a request runs"):
            pipeline.send_input(handle.request_id, InputText("more"))
        await handle.result()


async def test_client_input_of_an_undeclared_class_fails_its_request_and_ended_requests_drop_it(placement):
    from omnistage.core.payloads import InputText

    config = toy.linear_config(LINEAR_PROCESSES if placement == "multi_process" else None)
    config.stages[1].accepts_client_input = ["omnistage.core.payloads:InputText"]
    config.stages[1].can_accept_stream_before_payload = True  # the input may overtake the payload
    async with Pipeline(config) as pipeline:
        done = pipeline.submit(toy.ToyRequest("abc"))
        await done.result()
        assert pipeline.send_input(done.request_id, InputText("late")) is False  # ended: dropped
        slow = pipeline.submit(toy.ToyRequest("x" * 2000))
        assert pipeline.send_input(slow.request_id, "not InputText") is True
        with pytest.raises(StageFailureError, match="client input is str, but it declares .*InputText"):
            await slow.result()
        await assert_no_request_state(pipeline)
