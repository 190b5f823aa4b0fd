"""Each abort race path, made deterministic with gates; afterwards nothing is left."""

import asyncio

import pytest
import torch

from omnistage.config.pipeline import FactoryConfig, PipelineConfig, StageConfig
from omnistage.core.errors import RequestAbortedError
from omnistage.core.messages import Abort, StagePayload, StreamChunk
from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing import toy
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.waits import wait_until_async

pytestmark = pytest.mark.anyio


def two_stage(first: str, second: str) -> PipelineConfig:
    def stage(name, factory, **kw):
        return StageConfig(name=name, factory=FactoryConfig(path=f"omnistage.testing.toy:{factory}"), **kw)

    return PipelineConfig(stages=[stage("a", first, next="b"), stage("b", second, terminal=True)])


def released(stage: str, request_id: str) -> int:
    return toy.RELEASED.calls.get(stage, []).count(request_id)


async def test_abort_before_hand_off():
    """Aborted while the producer computes: the consumer never sees it, yet its
    release_callback runs (harmlessly) and the producer's late result is dropped."""
    toy.GATES.close("a:p1")
    async with Pipeline(two_stage("hold", "tag")) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("p1"))
        assert await asyncio.to_thread(toy.GATES.wait_entered, "a:p1")
        pipeline.abort(handle.request_id)
        with pytest.raises(RequestAbortedError):
            await handle.result()
        toy.GATES.open("a:p1")
        await assert_no_request_state(pipeline)
        await wait_until_async(lambda: released("a", handle.request_id) >= 1 and released("b", handle.request_id) >= 1)
        assert handle.request_id not in pipeline.host.stages["b"].scheduler.live_requests()


async def test_abort_after_hand_off_before_consumer_state():
    """The payload waits in the consumer's queue behind another request when the abort
    lands: the consumer drops it without computing it and releases it."""
    toy.GATES.close("b:first")
    async with Pipeline(two_stage("tag", "hold")) as pipeline:
        first = pipeline.submit(toy.ToyRequest("first"))
        assert await asyncio.to_thread(toy.GATES.wait_entered, "b:first")
        second = pipeline.submit(toy.ToyRequest("second"))
        await wait_until_async(lambda: second.request_id in pipeline.host.stages["b"].live_state().get("active", []))
        pipeline.abort(second.request_id)
        with pytest.raises(RequestAbortedError):
            await second.result()
        toy.GATES.open("b:first")
        assert (await first.result()).outputs == {"b": "first"}
        await assert_no_request_state(pipeline)
        await wait_until_async(lambda: released("b", second.request_id) >= 1)


async def test_producer_finishes_after_the_request_is_gone():
    """A threaded compute outlives its request: the result is dropped and the
    release_callback runs again (so it must be idempotent)."""
    toy.GATES.close("a:p3")
    async with Pipeline(two_stage("tag", "tag")) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("p3"))
        assert await asyncio.to_thread(toy.GATES.wait_entered, "a:p3")
        pipeline.abort(handle.request_id)
        await wait_until_async(lambda: released("a", handle.request_id) == 1)
        toy.GATES.open("a:p3")
        await wait_until_async(lambda: released("a", handle.request_id) == 2)
        await assert_no_request_state(pipeline)


async def test_abort_is_idempotent_and_unknown_ids_are_ignored():
    async with Pipeline(toy.linear_config()) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("x", delay_s=0.2))
        for _ in range(3):
            pipeline.abort(handle.request_id)
        pipeline.abort("never-submitted")
        with pytest.raises(RequestAbortedError):
            await handle.result()
        await assert_no_request_state(pipeline)


async def test_late_chunks_after_abort_never_recreate_streaming_state():
    async with Pipeline(toy.linear_config()) as pipeline:
        accumulate = pipeline.host.stages["accumulate"]
        request = toy.ToyRequest("late")
        accumulate.deliver(StreamChunk("r1", "double", torch.tensor([1]), request=request), "double")
        await wait_until_async(lambda: accumulate.live_state().get("scheduler") == ["r1"])
        accumulate.deliver(Abort("r1"), "main")
        await wait_until_async(lambda: not accumulate.live_state())
        accumulate.deliver(StreamChunk("r1", "double", torch.tensor([2]), request=request), "double")
        accumulate.deliver(StagePayload("r1", request, 2), "double")
        # the stage handles its inbox in order: once a later probe request shows up, the
        # late messages before it have been handled (no fixed sleep stands in for that)
        accumulate.deliver(StreamChunk("probe", "double", torch.tensor([1]), request=request), "double")
        await wait_until_async(lambda: accumulate.live_state().get("scheduler") == ["probe"])
        accumulate.deliver(Abort("probe"), "main")
        await wait_until_async(lambda: not accumulate.live_state())
