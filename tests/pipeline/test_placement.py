"""Replicas and the placement interface without Ray: config checks, the relay's path to
another node, and a replicated process group under the local placement (each request
on one replica for its life, load split by least outstanding)."""

import asyncio

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from omnistage.config.pipeline import PipelineConfig
from omnistage.core.errors import PipelineUnhealthyError
from omnistage.pipeline import relay
from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing import toy
from omnistage.testing.leaks import assert_no_request_state

pytestmark = pytest.mark.anyio


def linear_with(process: str | None, double_replicas: int) -> dict:
    config = toy.linear_config().model_dump()
    stages = [{**s, "process": process, "replicas": double_replicas if s["name"] == "double" else 1} for s in config["stages"]]
    return {**config, "stages": stages}


def test_replicas_need_a_process_group_and_agree_within_it():
    with pytest.raises(ValidationError, match="'double': replicas=2 needs a process group"):
        PipelineConfig.model_validate(linear_with(None, 2))
    with pytest.raises(ValidationError, match="'double': replicas=2, but stage 'encode' of the same process group 'g'"):
        PipelineConfig.model_validate(linear_with("g", 2))
    assert PipelineConfig.model_validate(linear_with("g", 1)).stage("double").replicas == 1


def test_a_tensor_for_another_node_travels_inline_and_comes_back_equal():
    prefix = "omnistage_test_inline_"
    big = torch.randn(300, 257).to(torch.bfloat16)  # past SHM_MIN_BYTES, a dtype numpy lacks
    array = np.arange(40_000, dtype=np.float32)
    small = torch.arange(5)
    data = relay.dumps({"big": big, "array": array, "small": small}, prefix, shared_memory=False)
    assert relay.sweep_segments(prefix) == 0  # no shared-memory segment was made
    back = relay.loads(data)
    assert back["big"].dtype == torch.bfloat16 and torch.equal(back["big"], big)
    assert np.array_equal(back["array"], array) and torch.equal(back["small"], small)
    shared = relay.dumps({"big": big}, prefix)
    assert len(shared) < big.nbytes  # same node: the bytes went to a segment
    assert torch.equal(relay.loads(shared)["big"], big) and relay.sweep_segments(prefix) == 0


def replicated_linear(process: dict[str, str] | None = None, **overrides) -> PipelineConfig:
    """double in 2 replicas of `engine`, accumulate in 2 replicas of `vocoder`: a request's
    stream and payload from double must reach the accumulate replica it runs on."""
    config = toy.linear_config({"double": "engine", "accumulate": "vocoder", **(process or {})}, **overrides)
    for name in ("double", "accumulate"):
        config.stage(name).replicas = 2
    return config


async def stream(handle):
    chunks = [chunk.data.tolist() async for chunk in handle.stream()]
    return chunks, await handle.result()


async def run_replicated(pipeline: Pipeline) -> None:
    """Six slow requests at once: three on each replica of each group, all correct."""
    texts = [f"request {n}" for n in range(6)]
    handles = [pipeline.submit(toy.ToyRequest(t, delay_s=0.3)) for t in texts]
    assert pipeline.host is not None
    load = {g: sorted(a[g] for a in pipeline.host.assignments.values()) for g in ("engine", "vocoder")}
    assert load == {"engine": [0, 0, 0, 1, 1, 1], "vocoder": [0, 0, 0, 1, 1, 1]}
    streams = await asyncio.gather(*(stream(h) for h in handles))
    for text, (chunks, result) in zip(texts, streams, strict=True):
        assert (chunks, result.outputs) == (toy.expected_linear(text)[0], {"accumulate": toy.expected_linear(text)[1]})
    await assert_no_request_state(pipeline)


async def test_local_replicas_split_the_load_and_keep_each_request_on_one():
    async with Pipeline(replicated_linear()) as pipeline:
        assert sorted(pipeline.processes) == ["engine@0", "engine@1", "vocoder@0", "vocoder@1"]
        await run_replicated(pipeline)


async def test_a_dead_replica_fails_only_its_requests_and_the_other_serves():
    async with Pipeline(replicated_linear(stage_restart_backoff_s=5.0)) as pipeline:
        first = pipeline.submit(toy.ToyRequest("on replica 0", delay_s=1.0))
        second = pipeline.submit(toy.ToyRequest("on replica 1", delay_s=1.0))
        pipeline.processes["engine@0"].kill()
        with pytest.raises(PipelineUnhealthyError, match="engine@0"):
            await first.result()
        assert (await second.result()).outputs["accumulate"] == toy.expected_linear("on replica 1")[1]
        assert pipeline.healthy and list(pipeline.down) == ["engine@0"]
        result = await pipeline.submit(toy.ToyRequest("while one is down")).result()  # goes to engine@1
        assert result.outputs["accumulate"] == toy.expected_linear("while one is down")[1]
