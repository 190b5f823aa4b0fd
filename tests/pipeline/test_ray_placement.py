"""Ray placement (``placement: ray``) on a real Ray cluster on this machine.

The two-node tests (``ray start --head`` plus a second raylet joining it, each with its own
custom resource; :class:`omnistage.testing.ray_cluster.LocalRayCluster`, one for the
module) are marked ``ray_cluster`` (run them alone with ``pytest -m ray_cluster
tests/pipeline/test_ray_placement.py``); CI runs them with the suite, this file first
(tests/conftest.py ``RUN_FIRST``). The single-node test (a private Ray instance started by
the pipeline) comes last: after a private instance, Ray 2.60 cannot create actors in
another cluster from the same process.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

import httpx  # noqa: E402
import torch  # noqa: E402

from omnistage.config.pipeline import PipelineConfig  # noqa: E402
from omnistage.core.errors import PipelineUnhealthyError  # noqa: E402
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig  # noqa: E402
from omnistage.models.qwen3_tts.random_checkpoint import write_random_checkpoint  # noqa: E402
from omnistage.pipeline.pipeline import Pipeline  # noqa: E402
from omnistage.pipeline.ray_placement import RayPlacement  # noqa: E402
from omnistage.serve.app import ServerSettings, create_app  # noqa: E402
from omnistage.serve.registry import ModelRegistry  # noqa: E402
from omnistage.testing import toy  # noqa: E402
from omnistage.testing.leaks import assert_no_request_state  # noqa: E402
from omnistage.testing.ray_cluster import LocalRayCluster  # noqa: E402
from omnistage.testing.tone import ToneConfig  # noqa: E402
from omnistage.testing.waits import wait_until_async  # noqa: E402
from tests.pipeline.test_placement import replicated_linear, run_replicated, stream  # noqa: E402
from tests.serve.conftest import run_uvicorn, wait_health  # noqa: E402
from tests.serve.test_server import expected_pcm, speech, wait_idle  # noqa: E402

pytestmark = pytest.mark.anyio

PROCESSES = {"encode": "pre", "double": "engine", "accumulate": "vocoder"}


def pin(config: PipelineConfig, nodes: dict[str, str]) -> PipelineConfig:
    """Each named stage on the node with that custom resource, one logical CPU each."""
    for stage, node in nodes.items():
        config.stage(stage).resources.custom = {node: 0.1}
    return config


# ------------------------------------------------------------------ two nodes
@pytest.fixture(scope="module")
def cluster():
    cluster = LocalRayCluster(cpus=4)
    try:
        cluster.start_head("head")
        cluster.add_node("worker")
        yield cluster
    finally:
        cluster.stop()


def assert_nothing_left_in(cluster: LocalRayCluster) -> None:
    """No live actor, no placement group, no object in the store, once the pipeline stopped."""
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        from ray._private.state import state

        alive = [a for a in state.actor_table(None).values() if a["State"] != "DEAD"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        assert alive == [] and groups == []
        store = ray.available_resources().get("object_store_memory")
        assert store == ray.cluster_resources().get("object_store_memory")
    finally:
        ray.shutdown()


@pytest.mark.ray_cluster
async def test_stages_on_two_nodes_with_replicas_serve_what_one_host_does(cluster):
    """encode on the head node; double and accumulate in two replicas each on the worker:
    tensors cross nodes inline, each request stays on its replicas."""
    # placement is under test here, not liveness (the hung/killed test below is): five actors
    # starting on a loaded 2-core machine went silent for 1.7 s, past the 2 s default
    config = replicated_linear({"encode": "pre"}, placement="ray", ray_address=cluster.address, process_death_timeout_s=30.0)
    pin(config, {"encode": "head", "double": "worker", "accumulate": "worker"})
    async with Pipeline(config) as pipeline:
        placement = pipeline.placement
        assert isinstance(placement, RayPlacement)
        assert pipeline.host is not None and pipeline.host.transport is not None
        assert pipeline.host.transport.remote >= {"engine@0", "engine@1", "vocoder@0", "vocoder@1"}
        await run_replicated(pipeline)
        chunks, result = await stream(pipeline.submit(toy.ToyRequest("tensor" * 4000)))  # 192 KB tensors
        assert result.outputs == {"accumulate": toy.expected_linear("tensor" * 4000)[1]}
        await assert_no_request_state(pipeline)
    assert_nothing_left_in(cluster)


@pytest.mark.ray_cluster
@pytest.mark.parametrize(
    ("death_timeout_s", "sig", "found_by"),
    [(2.0, signal.SIGSTOP, "silent for"), (60.0, signal.SIGKILL, "Ray restarted it")],
    ids=["hung", "killed"],
)
async def test_a_dead_or_hung_actor_fails_its_requests_and_its_restart_rejoins(cluster, death_timeout_s, sig, found_by):
    """A hung actor (stopped: alive for Ray, which will not restart it) is found by its
    silence, and killed so that Ray restarts it; a killed one (a death timeout longer than
    Ray's restart) by the hello of its restarted incarnation."""
    config = toy.linear_config(PROCESSES, placement="ray", ray_address=cluster.address, process_death_timeout_s=death_timeout_s)
    pin(config, {"double": "worker"})
    async with Pipeline(config) as pipeline:
        assert isinstance(pipeline.placement, RayPlacement)
        pid = ray.get(pipeline.placement.actors["engine"].pid.remote())
        handle = pipeline.submit(toy.ToyRequest("slow", delay_s=30))
        started = time.monotonic()
        os.kill(pid, sig)
        with pytest.raises(PipelineUnhealthyError, match=f"'engine'.*{found_by}"):
            await handle.result()
        assert time.monotonic() - started < min(death_timeout_s, 30.0)
        await wait_until_async(lambda: pipeline.healthy, 90, "the pipeline's health")
        assert ray.get(pipeline.placement.actors["engine"].pid.remote()) != pid
        result = await pipeline.submit(toy.ToyRequest("back")).result()
        assert result.outputs == {"accumulate": toy.expected_linear("back")[1]}
        await assert_no_request_state(pipeline)
    assert_nothing_left_in(cluster)


def served_pcm(config: PipelineConfig, bodies: list[dict]) -> list[bytes]:
    """The PCM bytes a server of ``config`` answers to each body (one at a time)."""
    out = []
    for server in run_uvicorn(create_app(config, ServerSettings(warmup=False, playground=False))):
        assert wait_health(server.base_url, 300).status_code == 200
        for body in bodies:
            response = httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=120)
            assert response.status_code == 200, response.text
            out.append(response.content)
        wait_idle(server)
        server.assert_no_request_state()
    return out


def in_groups(config: PipelineConfig, groups: dict[str, tuple[str, str]]) -> PipelineConfig:
    """``config`` with its stages in process groups (stage -> (group, node)), under local
    placement: the reference, whose models load in stage processes (not in the test
    process, which would keep their memory for the rest of the suite)."""
    config = config.model_copy(deep=True)
    for stage, (group, _) in groups.items():
        config.stage(stage).process = group
    return config


def across_nodes(config: PipelineConfig, cluster: LocalRayCluster, groups: dict[str, tuple[str, str]]) -> PipelineConfig:
    """:func:`in_groups` under Ray placement, each stage pinned to its node. Each group asks
    for as many CPUs as this machine has cores: Ray sets an actor's OMP_NUM_THREADS to its
    CPUs, torch computes with that many threads, and the float sums of the audio depend on
    it; so it matches the thread count of a local stage process."""
    config = in_groups(config, groups).model_copy(update={"placement": "ray", "ray_address": cluster.address})
    for stage, (group, _) in groups.items():
        members = sum(g == group for g, _ in groups.values())
        config.stage(stage).resources.cpus = torch.get_num_threads() / members
    return pin(config, {stage: node for stage, (_, node) in groups.items()})


@pytest.mark.ray_cluster
def test_piper_across_two_nodes_speaks_the_bytes_of_local_placement(cluster):
    config = ModelRegistry.discover().resolve(None)
    # Piper takes no seed; without noise it is deterministic (its ONNX noise is unseeded)
    quiet = {"response_format": "pcm", "noise_scale": 0.0, "noise_w": 0.0}
    bodies = [{"input": "Two nodes, one voice.", **quiet}, {"input": "A second one, streamed.", "stream": True, **quiet}]
    groups = {"preprocessing": ("text", "head"), "synthesis": ("voice", "worker")}
    local = served_pcm(in_groups(config, groups), bodies)
    assert served_pcm(across_nodes(config, cluster, groups), bodies) == local
    assert_nothing_left_in(cluster)


@pytest.mark.ray_cluster
def test_tiny_qwen3_tts_across_two_nodes_speaks_the_bytes_of_local_placement(cluster, tmp_path):
    path = write_random_checkpoint(tmp_path / "custom_voice", "tiny", "custom_voice", seed=0)
    config = Qwen3TTSPipelineConfig.for_model_path(str(path))
    body = {"input": "Hello there.", "voice": "aiden", "seed": 7, "max_new_tokens": 8, "response_format": "pcm"}
    bodies = [{**body, "stream": False}, {**body, "stream": True}]
    groups = {"preprocessing": ("talker", "head"), "tts_engine": ("talker", "head"), "vocoder": ("codec", "worker")}
    local = served_pcm(in_groups(config, groups), bodies)
    assert served_pcm(across_nodes(config, cluster, groups), bodies) == local
    assert_nothing_left_in(cluster)


@pytest.mark.ray_cluster
def test_a_lost_node_fails_in_flight_requests_turns_health_503_and_its_return_restores_service(cluster):
    config = ToneConfig.for_model_path("tone-test")
    config = across_nodes(config, cluster, {config.stages[0].name: ("synth", "worker")})
    config = config.model_copy(update={"process_death_timeout_s": 1.0, "max_stage_restarts": 5})
    for server in run_uvicorn(create_app(config, ServerSettings(warmup=False, playground=False))):
        assert wait_health(server.base_url, 120).status_code == 200
        assert speech(server, {"input": "hi", "response_format": "pcm"}).content == expected_pcm("hi")
        with httpx.stream("POST", f"{server.base_url}/v1/audio/speech", timeout=60,
                          json={"input": "abcdefghij", "delay_s": 1.0, "response_format": "pcm", "stream": True}) as response:  # fmt: skip
            chunks = response.iter_bytes()
            assert next(chunks)  # audio is flowing
            started = time.monotonic()
            cluster.kill_node("worker")
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                b"".join(chunks)  # the stream is cut: it ends without its last chunk
        assert time.monotonic() - started < config.process_death_timeout_s + 1.5
        down = httpx.get(f"{server.base_url}/health")
        assert down.status_code == 503 and down.json()["stages_down"] == ["tone"], down.text
        assert speech(server, {"input": "hi"}).status_code == 503
        cluster.add_node("worker")  # Ray places the lost bundle again; the actor restarts and rejoins
        deadline = time.monotonic() + 120
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert speech(server, {"input": "back", "response_format": "pcm"}).content == expected_pcm("back")
        wait_idle(server)
        server.assert_no_request_state()  # the cut stream's included, in every live process
    assert_nothing_left_in(cluster)


async def test_one_node_ray_placement_serves_the_same_and_leaves_nothing():
    """One actor (the suite's memory peak must not grow by a process per group)."""
    config = toy.linear_config({"double": "engine"}, placement="ray")
    async with Pipeline(config) as pipeline:
        assert isinstance(pipeline.placement, RayPlacement)
        assert sorted(pipeline.placement.actors) == ["engine"]
        chunks, result = await stream(pipeline.submit(toy.ToyRequest("tensor" * 4000)))
        assert (chunks, result.outputs) == (toy.expected_linear("tensor" * 4000)[0], {"accumulate": toy.expected_linear("tensor" * 4000)[1]})
        await assert_no_request_state(pipeline)  # shared-memory segments included
    assert not ray.is_initialized()  # the private instance is gone with the pipeline


