"""Failure paths outside the happy flow: every request still ends, typed, and nothing is
left behind (regressions found in review)."""

import asyncio
import threading
import time

import numpy as np
import pytest

from omnistage.core.errors import (
    PipelineConfigError,
    PipelineUnhealthyError,
    RequestValidationError,
    StageFailureError,
    StreamBufferFullError,
)
from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing import toy
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.tone import ToneConfig, ToneRequest, tone_samples

pytestmark = pytest.mark.anyio
APART = ("a", "b")


async def test_unserializable_result_fails_its_request_and_serving_goes_on():
    async with Pipeline(toy.two_stage_config("misbehave", "tag", APART)) as pipeline:
        with pytest.raises(StageFailureError, match="cannot send"):
            await asyncio.wait_for(pipeline.submit(toy.ToyRequest("LOCK")).result(), 10)
        assert (await pipeline.submit(toy.ToyRequest("fine")).result()).outputs == {"b": ("b", "fine")}
        await assert_no_request_state(pipeline)


async def test_unserializable_terminal_result_in_a_child_fails_its_request():
    async with Pipeline(toy.two_stage_config("tag", "misbehave", APART)) as pipeline:
        with pytest.raises(StageFailureError, match="cannot send"):
            await asyncio.wait_for(pipeline.submit(toy.ToyRequest("LOCK")).result(), 10)
        assert (await pipeline.submit(toy.ToyRequest("fine")).result()).outputs == {"b": "fine"}
        await assert_no_request_state(pipeline)


@pytest.mark.parametrize("processes", [(None, None), APART])
async def test_model_defined_typed_errors_arrive_typed(processes):
    async with Pipeline(toy.two_stage_config("tag", "misbehave", processes)) as pipeline:
        with pytest.raises(toy.ToyQuotaError) as info:
            await asyncio.wait_for(pipeline.submit(toy.ToyRequest("QUOTA")).result(), 10)
        assert (info.value.who, info.value.limit, info.value.http_status) == ("toy", 3, 429)
        await assert_no_request_state(pipeline)


async def test_a_dead_compute_loop_fails_its_requests_and_marks_the_pipeline_unhealthy():
    async with Pipeline(toy.two_stage_config("tag", "crashing")) as pipeline:
        with pytest.raises(PipelineUnhealthyError, match="stopped computing"):
            await asyncio.wait_for(pipeline.submit(toy.ToyRequest("CRASH")).result(), 10)
        assert not pipeline.healthy
        with pytest.raises(PipelineUnhealthyError):
            pipeline.submit(toy.ToyRequest("next"))


async def test_a_stage_process_that_fails_to_build_fails_start_up_at_once():
    config = toy.two_stage_config("tag", "broken_factory", APART)
    start = time.monotonic()
    with pytest.raises(PipelineConfigError, match="a factory that fails to build"):
        async with Pipeline(config):
            pass
    assert time.monotonic() - start < 30


async def test_a_main_process_stage_that_fails_to_build_leaves_no_threads():
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(KeyError):
        async with Pipeline(toy.two_stage_config("broken_factory", "tag", (None, "b"))):
            pass
    leftover = {t.name for t in threading.enumerate()} - before
    assert not [name for name in leftover if name.startswith("zmq-")]


async def test_a_terminal_outside_the_requests_terminal_set_fails_it_clearly():
    """Hooks that agree on the sample requests but not on this one: the talker chain runs
    although the terminal set is only `decode`; its terminal's completion fails the
    request (never a silent extra output), and every stage lets the request go."""
    config = toy.omni_config()
    thinker = config.stage("thinker")
    thinker.route_fn = "omnistage.testing.toy:omni_route_thinker_mismatch"
    thinker.stream_done_to_fn = "omnistage.testing.toy:omni_streams_mismatch"
    toy.GATES.close("decode:MISMATCH")  # decode finishes last, deterministically
    async with Pipeline(config) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("MISMATCH", audio_out=False))
        with pytest.raises(StageFailureError, match="not in its terminal set") as info:
            await asyncio.wait_for(handle.result(), 10)
        assert info.value.stage == "code2wav"
        toy.GATES.open("decode:MISMATCH")
        await assert_no_request_state(pipeline)


async def test_request_ids_cannot_be_reused_while_stages_remember_them():
    async with Pipeline(toy.linear_config()) as pipeline:
        await pipeline.submit(toy.ToyRequest("once"), request_id="client-42").result()
        with pytest.raises(RequestValidationError, match="client-42"):
            pipeline.submit(toy.ToyRequest("twice"), request_id="client-42")


async def test_a_request_that_cannot_reach_the_entry_process_is_not_admitted():
    async with Pipeline(toy.two_stage_config("tag", "tag", APART)) as pipeline:
        with pytest.raises(StageFailureError, match="cannot send"):
            pipeline.submit(toy.ToyRequest(threading.Lock()))  # type: ignore[arg-type]
        assert pipeline.coordinator.in_flight == 0
        await assert_no_request_state(pipeline)


async def test_abandoned_streams_release_their_bytes_and_collecting_clients_are_not_capped():
    async with Pipeline(toy.linear_config(stream_queue_max_bytes=400)) as pipeline:
        for _ in range(5):
            handle = pipeline.submit(toy.ToyRequest("abcdefghijkl"))
            async for _chunk in handle.stream():
                break  # the client stops reading
            await asyncio.wait_for(handle._done.wait(), 5)
            handle.close()
        assert pipeline.coordinator.queued_bytes == 0
        text = "x" * 200  # 1,600 bytes of chunks, 4x the cap
        with pytest.raises(StreamBufferFullError):
            await pipeline.submit(toy.ToyRequest(text)).result()
        whole = await pipeline.submit(toy.ToyRequest(text), collect=True).result()
        assert [c.data.tolist() for c in whole.chunks] == toy.expected_linear(text)[0]
        await assert_no_request_state(pipeline)


async def test_stream_after_result_ends_instead_of_hanging():
    async with Pipeline(toy.linear_config()) as pipeline:
        handle = pipeline.submit(toy.ToyRequest("abc"))
        await handle.result()
        assert [c async for c in handle.stream()] == []


async def test_chunks_that_came_before_a_failure_reach_a_client_that_reads_late():
    """A terminal stage streams one chunk, then fails. The client starts reading only after
    the request ended (what a loaded machine does to a server's handler): it still gets
    that chunk, then the error, and the chunk no longer counts against the byte cap."""
    request = ToneRequest("LATEFAIL", "sine", 1.0, 10_000, 0.0)
    async with Pipeline(ToneConfig.for_model_path("tone-test")) as pipeline:
        handle = pipeline.submit(request)
        await asyncio.wait_for(handle._done.wait(), 10)
        assert pipeline.coordinator.queued_bytes == 0
        chunks = []
        with pytest.raises(StageFailureError, match="after the first chunk"):
            async for chunk in handle.stream():
                chunks.append(chunk.data.samples)
        assert len(chunks) == 1 and np.array_equal(chunks[0], tone_samples(request)[0])


async def test_a_client_past_its_stream_cap_is_aborted_and_a_reading_client_is_not():
    config = toy.linear_config(stream_queue_max_bytes=100_000, stream_request_max_bytes=240)
    async with Pipeline(config) as pipeline:
        stalled = pipeline.submit(toy.ToyRequest("s" * 200))  # 1,600 bytes, never read
        reader = pipeline.submit(toy.ToyRequest("r" * 30))  # 240 bytes: within the cap
        chunks = [c.data.tolist() async for c in reader.stream()]
        assert chunks == toy.expected_linear("r" * 30)[0]
        with pytest.raises(StreamBufferFullError, match="per-request cap is 240") as err:
            await stalled.result()
        assert err.value.http_status == 499 and stalled._finish_reason == "abort"
        assert pipeline.coordinator.queued_bytes == 0
        await assert_no_request_state(pipeline)


async def test_at_the_global_cap_the_request_holding_the_most_is_aborted_not_the_newcomer():
    config = toy.linear_config(stream_queue_max_bytes=600, stream_request_max_bytes=600)
    async with Pipeline(config) as pipeline:
        first = pipeline.submit(toy.ToyRequest("a" * 60))  # 480 bytes, ends unread
        await first.wait_finished()
        assert first.error is None and first.queued_bytes == 480
        second = pipeline.submit(toy.ToyRequest("b" * 30))  # 240 bytes: 720 > 600 together
        await second.wait_finished()
        assert second.error is None and second.queued_bytes == 240
        with pytest.raises(StreamBufferFullError, match="global cap of 600"):
            [c async for c in first.stream()]  # dropped, and it says so: never a short success
        assert [c.data.tolist() async for c in second.stream()] == toy.expected_linear("b" * 30)[0]
        assert pipeline.coordinator.queued_bytes == 0
        await assert_no_request_state(pipeline)
