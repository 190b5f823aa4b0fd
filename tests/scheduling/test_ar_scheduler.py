"""The AR engine as a pipeline stage: frames stream to the next stage as they are made,
results carry finish_reason, aborts free KV blocks at once, nothing is left behind."""

import asyncio

import pytest
import torch

from omnistage.core.errors import RequestAbortedError, RequestValidationError
from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.toy_ar import reference_generate
from omnistage.testing.toy_ar_stage import (
    ToyARRequest,
    ar_pipeline_config,
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


async def test_concurrent_requests_stream_every_frame_and_match_the_reference():
    requests = [ToyARRequest(3 + i, 6 + 3 * i, seed=i) for i in range(6)]  # more than the 4 slots
    model = toy_ar_model()
    async with Pipeline(ar_pipeline_config()) as pipeline:
        handles = [pipeline.submit(r) for r in requests]
        results = await asyncio.gather(*(h.result() for h in handles))
        for request, result in zip(requests, results, strict=True):
            streamed, generated = result.outputs["collect"]
            expected, reason = reference_generate(model, toy_ar_input(request))
            assert result.finish_reason == generated.finish_reason == reason == "length"
            assert torch.equal(streamed, expected) and torch.equal(generated.codes, expected)
            client_frames = torch.cat([chunk.data for chunk in result.chunks])
            assert torch.equal(client_frames, expected)
        await assert_no_request_state(pipeline)
        engine = engine_of(pipeline)
        assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks


async def test_abort_mid_decode_frees_the_kv_blocks_at_once():
    async with Pipeline(ar_pipeline_config()) as pipeline:
        engine = engine_of(pipeline)
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
