"""Cost of Ray placement on one machine (CPU): the transport choice and the per-request
overhead for the tiny Qwen3-TTS.

Starts a two-node local Ray cluster on loopback (:class:`LocalRayCluster`: a head and a
worker node, each its own raylet) and measures:

1. ``transport``: between a process on the head node and an actor on the worker node,
   the round trip of a small control message over a ZMQ ``tcp://`` PUSH/PULL pair (the
   transport omnistage uses) vs a Ray actor call and vs a Ray compiled-graph channel
   (``experimental_compile`` of a one-actor DAG: Ray's own channels), and the one-way
   cost of a CPU tensor
   of 64 KiB .. 8 MiB sent inline in a ZMQ message (:mod:`omnistage.pipeline.relay`,
   ``shared_memory=False``) vs through Ray's object store (``ray.put`` on one node,
   ``ray.get`` on the other, which the object manager transfers between the nodes).
2. ``qwen3_tts``: a tiny random Qwen3-TTS CustomVoice checkpoint (seed 0) served by a
   pipeline with the same process groups (``talker``: preprocessing + tts_engine;
   ``codec``: vocoder) under ``placement: local`` (spawned processes) and ``placement:
   ray`` (talker on the head node, codec on the worker node): TTFA at the coordinator
   (submit -> first audio chunk) and frames per second (12.5 Hz frames of the audio
   returned per second of request wall time), median over ``--requests`` sequential
   requests after one warm-up (the two pipelines run at once and take turns), and the
   Ray/local ratios.

Usage: ``python benchmarks/ray_placement.py --output benchmarks/results/ray_placement_cpu.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
import zmq
from ray.dag import InputNode

from omnistage.core.payloads import AudioChunk
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.random_checkpoint import write_random_checkpoint
from omnistage.pipeline import relay
from omnistage.pipeline.pipeline import Pipeline
from omnistage.serve.media import MediaPolicy
from omnistage.testing.ray_cluster import LocalRayCluster

FRAME_SAMPLES = 24_000 / 12.5  # Qwen3-TTS: 12.5 frames per second of 24 kHz audio
SIZES = [64 * 1024, 1024 * 1024, 8 * 1024 * 1024]


@ray.remote
class Echo:
    """On the worker node: answers ZMQ pings and Ray calls, and receives tensors."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        ip = ray.get_runtime_context().worker.node_ip_address
        self.pull.bind(f"tcp://{ip}:*")
        self.push: zmq.Socket | None = None

    def address(self) -> str:
        return self.pull.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, address: str) -> None:
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect(address)

    def serve(self, count: int, decode: bool) -> None:
        """Answer ``count`` ZMQ messages with a one-byte ack (decoding each body)."""
        assert self.push is not None
        for _ in range(count):
            body = self.pull.recv()
            if decode:
                relay.loads(body)
            self.push.send(b"k")

    def ping(self) -> bytes:
        return b"k"

    def echo(self, body: bytes) -> bytes:
        return body

    def take(self, refs: list[ray.ObjectRef]) -> int:
        return ray.get(refs[0]).nbytes


def measure_transport(repeats: int) -> dict:
    echo = Echo.options(resources={"worker": 0.1}, num_cpus=0).remote()
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    ip = ray.get_runtime_context().worker.node_ip_address
    pull.bind(f"tcp://{ip}:*")
    ray.get(echo.connect.remote(pull.getsockopt_string(zmq.LAST_ENDPOINT)))
    push = context.socket(zmq.PUSH)
    push.connect(ray.get(echo.address.remote()))

    def zmq_round_trips(body: bytes, decode: bool) -> list[float]:
        served = echo.serve.remote(repeats, decode)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            push.send(body)
            pull.recv()
            times.append(time.perf_counter() - start)
        ray.get(served)
        return times

    small = relay.dumps(("abort", "req-0123456789ab"), "unused_")
    with InputNode() as source:
        graph = echo.echo.bind(source).experimental_compile()
    channel = [_timed(lambda: ray.get(graph.execute(small))) for _ in range(repeats)]
    graph.teardown()
    out: dict = {
        "control_round_trip_ms": {
            "zmq_tcp": _ms(zmq_round_trips(small, decode=True)),
            "ray_actor_call": _ms([_timed(lambda: ray.get(echo.ping.remote())) for _ in range(repeats)]),
            "ray_compiled_graph_channel": _ms(channel),
        },
        "tensor_one_way_ms": {},
    }
    for size in SIZES:
        tensor = torch.randn(size // 4)

        def inline(tensor: torch.Tensor = tensor) -> bytes:
            return relay.dumps(tensor, "unused_", shared_memory=False)

        zmq_times = [t + _timed(inline) for t in zmq_round_trips(inline(), decode=True)]  # serialize + send + decode
        store_times = [_timed(lambda t=tensor: ray.get(echo.take.remote([ray.put(t)]))) for _ in range(repeats)]
        out["tensor_one_way_ms"][f"{size // 1024}KiB"] = {"zmq_inline": _ms(zmq_times), "ray_object_store": _ms(store_times)}
    ray.kill(echo)
    context.destroy(linger=0)
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ms(times: list[float]) -> dict:
    return {"p50": round(statistics.median(times) * 1000, 3), "min": round(min(times) * 1000, 3)}


async def one_request(pipeline: Pipeline, config: Qwen3TTSPipelineConfig, seed: int, frames: int) -> tuple[float, float]:
    """``(TTFA s, frames per s)`` of one streamed request."""
    speech = config.speech_request(input="Hello there, this is a benchmark.", voice="aiden", seed=seed, max_new_tokens=frames)
    request = config.build_request(speech, MediaPolicy())
    start = time.perf_counter()
    handle = pipeline.submit(request)
    first, samples = None, 0
    async for chunk in handle.stream():
        if isinstance(chunk.data, AudioChunk):
            first = time.perf_counter() - start if first is None else first
            samples += len(chunk.data.samples)
    await handle.result()
    assert first is not None
    return first, samples / FRAME_SAMPLES / (time.perf_counter() - start)


async def measure_pipelines(configs: dict[str, Qwen3TTSPipelineConfig], requests: int, frames: int) -> dict:
    """Both pipelines run at once and take turns, one request each, so that the load of a
    shared machine falls on both alike; the first round warms up."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    pipelines = {name: Pipeline(config) for name, config in configs.items()}
    for pipeline in pipelines.values():
        await pipeline.start()
    try:
        for n in range(requests + 1):
            for name, pipeline in pipelines.items():
                measured = await one_request(pipeline, configs[name], 7 + n, frames)
                if n:
                    runs[name].append(measured)
    finally:
        for pipeline in pipelines.values():
            await pipeline.stop()
    return {
        name: {"ttfa_ms_p50": round(statistics.median(t for t, _ in run) * 1000, 1),
               "frames_per_s_p50": round(statistics.median(f for _, f in run), 2)}
        for name, run in runs.items()
    }  # fmt: skip


def placed(config: Qwen3TTSPipelineConfig, placement: str, address: str) -> Qwen3TTSPipelineConfig:
    config = config.model_copy(deep=True, update={"placement": placement, "ray_address": address})
    groups = {"preprocessing": ("talker", "head"), "tts_engine": ("talker", "head"), "vocoder": ("codec", "worker")}
    for stage, (group, node) in groups.items():
        config.stage(stage).process = group
        config.stage(stage).resources.custom = {node: 0.1}
        # Ray sets OMP_NUM_THREADS to an actor's CPUs: give each group this machine's cores,
        # the thread count a spawned process has
        config.stage(stage).resources.cpus = torch.get_num_threads() / (2 if group == "talker" else 1)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--frames", type=int, default=48, help="max_new_tokens of each request")
    parser.add_argument("--repeats", type=int, default=50, help="samples per transport measurement")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    cluster = LocalRayCluster(cpus=4)
    started = time.perf_counter()
    try:
        cluster.start_head("head")
        cluster.add_node("worker")
        cluster_start_s = time.perf_counter() - started
        with tempfile.TemporaryDirectory() as root:
            path = write_random_checkpoint(Path(root) / "custom_voice", "tiny", "custom_voice", seed=0)
            config = Qwen3TTSPipelineConfig.for_model_path(str(path))
            configs = {"local": placed(config, "local", cluster.address), "ray": placed(config, "ray", cluster.address)}
            measured = asyncio.run(measure_pipelines(configs, args.requests, args.frames))
            local, on_ray = measured["local"], measured["ray"]
        ray.init(address=cluster.address, log_to_driver=False)
        transport = measure_transport(args.repeats)
        ray.shutdown()
    finally:
        cluster.stop()
    result = {
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "torch_threads": torch.get_num_threads(),
        "ray": ray.__version__,
        "cluster_start_s": round(cluster_start_s, 1),
        "transport": transport,
        "qwen3_tts_tiny": {
            "requests": args.requests,
            "frames_per_request": args.frames,
            "local": local,
            "ray_two_nodes": on_ray,
            "ttfa_ratio_ray_over_local": round(on_ray["ttfa_ms_p50"] / local["ttfa_ms_p50"], 3),
            "frames_per_s_ratio_ray_over_local": round(on_ray["frames_per_s_p50"] / local["frames_per_s_p50"], 3),
        },
    }
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
