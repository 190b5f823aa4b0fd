"""Host CPU per step of a Qwen3-Omni chat request with an image or an audio clip (CPU, no GPU
needed), for source trees side by side.

The served media prompts at concurrency 64 are bound by the host (issue 17), not the GPU.
On a CPU the model's compute dominates wall times; the host steps can still be timed one by
one, in process, with the request bodies of ``qwen3_omni_served.py`` (a random 640x480 PNG
data URI, 1.2 MB of base64; a 3 s 16 kHz WAV clip) and the tiny random checkpoint, whose
feature and patch geometry is the real model's (128 mel bins, 16-pixel patches, merge 2,
temporal patch 2; no ``preprocessor_config.json``, so both take the processor's defaults).
Steps, in request order (CPU milliseconds per request: this process's user + system time,
torch held to one thread, so a step's time is its work, not the machine's parallelism):

- ``http parse + validate``: the body to the typed chat request (``parse_chat_request``,
  ``validate_chat_request``);
- ``media read + decode (server)``: the server process's share of ``load_chat_inputs`` (the
  data URI's checks and the decoder pool round trip; the base64 decoding too in trees before
  it moved to the worker, issue 17); ``media decode (decoder worker)``: the worker processes'
  CPU over the same calls (``/proc``);
- ``request build``: the model's request builder (prompt count, length checks, resample);
- ``preprocessing stage``: the stage's compute as served (the processor, MRoPE positions);
  inside it ``processor: audio features`` / ``processor: image patches``, ``processor:
  prompt ids`` and ``positions``, each timed alone;
- ``<encoder> stage``: the encoder stage's compute over a batch of ``--batch`` such
  prompts, per prompt, and ``<encoder> forward``: the bare model call on the same batch
  (the tiny model's compute; the difference is the stage's host glue);
- ``thinker merge + build_input``: the thinker's fan-in merge hook and its engine input
  (the encoder rows put at their placeholders, deepstack rows): host work on the thinker's
  engine thread.

``--burst C``: instead of the steps, the ``admitted`` phase under load, as served: per tree an
``omnistage serve`` of the tiny random config (``--load-format dummy``, ``--log-level debug``,
the engines sized for ``C`` streams, :func:`qwen3_omni_served.default_server_args`), one warm-up
image request, then ``--bursts`` times ``C`` streamed image+text chats with audio sent at once
(each its own image, ``max_tokens`` 8), the trees' servers up together and their bursts
alternating (:func:`bursts_of`); per request the server's ``admitted`` phase (HTTP
request read to its hand-off to the pipeline: body read, parse, validation, base64, the decoder
pool, request build) read from its DEBUG TTFA line, and the client's TTFA; their p50/p99.

Each ``--config NAME ROOT`` (a source tree, e.g. ``git archive REV | tar -x -C ROOT``) runs
in a child process with ``PYTHONPATH=ROOT`` and this file's measuring code, so the trees
are timed by the same code in one run; the speech prompt's AudioSetup stream is not sent
(the preprocessing stage runs with ``audio_output`` off; its cost is a dataclass). Prints a
table and writes ``--output``:

    git archive 5dc7baf | tar -x -C /tmp/before
    python benchmarks/qwen3_omni_host_cost.py --config before /tmp/before --config after . \\
        --output benchmarks/results/qwen3_omni_host_cost.json
    python benchmarks/qwen3_omni_host_cost.py --burst 32 --bursts 3 --config before /tmp/before \
        --config after . --output benchmarks/results/qwen3_omni_admission_burst.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

KINDS = ("image+text", "audio+text")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """``(CPU ms per call of this process, the last result)`` over ``repeats`` calls after one
    untimed call."""
    out = fn()
    start = time.process_time()
    for _ in range(repeats):
        out = fn()
    return 1e3 * (time.process_time() - start) / repeats, out


def measure(checkpoint: Path, repeats: int, batch: int) -> dict:
    """The steps of the module docstring for each prompt kind, in this process."""
    import torch

    torch.set_num_threads(1)
    import omnistage
    from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
    from omnistage.pipeline.stage import build_scheduler

    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint))
    schedulers = {s.name: build_scheduler(config, s) for s in config.stages if s.name in
                  ("preprocessing", "image_encoder", "audio_encoder", "thinker")}  # fmt: skip
    out = {
        kind: measure_kind(kind, checkpoint, config, schedulers, repeats, batch) for kind in KINDS
    }
    return {"omnistage": str(Path(omnistage.__file__).parent), "steps_cpu_ms": out}


def measure_kind(
    kind: str, checkpoint: Path, config, schedulers: dict, repeats: int, batch: int
) -> dict[str, float]:
    """One prompt kind's steps (CPU ms per request)."""
    from qwen3_omni_served import prompt_content

    from omnistage.core.messages import StagePayload
    from omnistage.models.qwen3_omni import stages
    from omnistage.models.qwen3_omni.modeling.config import load_config
    from omnistage.models.qwen3_omni.modeling.mrope import prompt_positions
    from omnistage.models.qwen3_omni.request_builders import Qwen3OmniChatRequest
    from omnistage.serve.chat_media import load_chat_inputs
    from omnistage.serve.chat_protocol import parse_chat_request, validate_chat_request
    from omnistage.serve.decoding import shared_pool
    from omnistage.serve.media import MediaPolicy

    caps, policy = config.capabilities(), MediaPolicy()
    thinker_config = load_config(str(checkpoint)).thinker
    processor = stages.Qwen3OmniProcessor.from_checkpoint(str(checkpoint), thinker_config.audio)
    body = json.dumps({
        "model": "qwen3-omni", "messages": [{"role": "user", "content": prompt_content(kind, 7)}],
        "stream": True, "modalities": ["text", "audio"], "audio": {"voice": caps.voices[0], "format": "pcm16"},
        "max_tokens": 48,
    }).encode()  # fmt: skip
    steps: dict[str, float] = {}
    steps["http parse + validate"], chat = timed(
        lambda: validate_chat_request(parse_chat_request(body, Qwen3OmniChatRequest), caps), repeats
    )  # fmt: skip
    load_chat_inputs(chat, caps, policy)  # the decoder workers started
    workers = shared_pool().pids
    before = sum(process_cpu_s(pid) for pid in workers)
    steps["media read + decode (server)"], turns = timed(
        lambda: load_chat_inputs(chat, caps, policy), repeats
    )
    steps["media decode (decoder worker)"] = (
        1e3 * (sum(process_cpu_s(p) for p in workers) - before) / (repeats + 1)
    )
    steps["request build"], built = timed(lambda: config.build_request(chat, turns), repeats)
    request = dataclasses.replace(built, audio_output=False)
    payload = StagePayload("r", request, None)
    steps["preprocessing stage"], prompt = timed(
        lambda: schedulers["preprocessing"].compute(payload), repeats
    )
    parts = [p for m in request.messages for p in m.parts]
    if kind == "audio+text":
        audios = [p.audio for p in parts if p.kind == "audio"]
        steps["  processor: audio features"], _ = timed(
            lambda: processor.audio_features(audios), repeats
        )
    else:
        images = [p.image for p in parts if p.kind == "image"]
        steps["  processor: image patches"], _ = timed(
            lambda: processor.image_patches(images), repeats
        )
    steps["  processor: prompt ids"], _ = timed(
        lambda: processor.prompt_ids(request.messages), repeats
    )
    ids = prompt.input_ids.tolist()
    steps["  positions"], _ = timed(
        lambda: prompt_positions(ids, thinker_config, prompt.layout), repeats
    )
    encoder = "image_encoder" if kind == "image+text" else "audio_encoder"
    many = [StagePayload(f"r{i}", request, prompt) for i in range(batch)]
    stage_ms, encoded = timed(lambda: schedulers[encoder].compute(many), max(1, repeats // batch))
    steps[f"{encoder} stage (batch {batch}, per prompt)"] = stage_ms / batch
    module = model_of(checkpoint, encoder)
    steps[f"{encoder} forward (batch {batch}, per prompt)"] = (
        forward_ms(module, many, repeats) / batch
    )
    fan_in = {encoder: StagePayload("r", request, encoded[0])}
    steps["thinker merge + build_input"], _ = timed(
        lambda: schedulers["thinker"].build_input(StagePayload("r", request, stages.thinker_merge(fan_in))), repeats
    )  # fmt: skip
    return {name: round(ms, 3) for name, ms in steps.items()}


def model_of(checkpoint: Path, encoder: str):
    import torch

    from omnistage.models.qwen3_omni.modeling.model import load_model

    part = "visual" if encoder == "image_encoder" else "audio_tower"
    return getattr(load_model(str(checkpoint), torch.device("cpu"), parts=(part,)), part)


def forward_ms(module, payloads: list, repeats: int) -> float:
    """CPU ms of the bare encoder call on the payloads' prompts (one call)."""
    import torch

    prompts = [p.data for p in payloads]
    with torch.inference_mode():
        if prompts[0].pixel_values is not None:
            pixels = torch.cat([p.pixel_values for p in prompts])
            grids = torch.cat([p.image_grid_thw for p in prompts])
            ms, _ = timed(lambda: module(pixels, grids), max(1, repeats // len(prompts)))
        else:
            features = torch.cat([p.audio_features for p in prompts], dim=1)
            frames = torch.cat([p.audio_frames for p in prompts])
            counts = [len(p.audio_frames) for p in prompts]
            ms, _ = timed(
                lambda: module(features, frames, prompts=counts), max(1, repeats // len(prompts))
            )
    return ms


#: The server's DEBUG line per request that sent audio (:func:`omnistage.serve.server_core.record_first_audio`).
ADMITTED_LINE = re.compile(r"TTFA [\d.]+ ms = admitted=\+([\d.]+)")


def bursts_of(roots: dict[str, Path], concurrency: int, bursts: int, logs: Path) -> dict[str, dict]:
    """The ``--burst`` measurement (module docstring) of each tree (name -> root): all the
    servers up at once (idle but for their own bursts), the bursts alternating between them
    (tree A's first, tree B's first, A's second, ...) so the trees see the same machine load;
    per tree the server's ``admitted`` ms and the client's TTFA ms, their p50/p99/mean.

    Raises:
        RuntimeError: a server exited; AssertionError: one was not healthy in 10 min, or a
            request failed.
    """
    import httpx
    import numpy as np
    from qwen3_omni_served import (
        chat,
        default_server_args,
        request_body,
        stop_server,
        wait_healthy,
        write_model_dir,
    )

    from omnistage.testing.waits import free_port

    model_dir = write_model_dir("tiny")
    config = json.loads((model_dir / "config.json").read_text())
    servers: dict[str, tuple[subprocess.Popen, int, Path]] = {}

    async def send(port: int, bodies: list[dict]) -> list:
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits
        ) as client:
            return await asyncio.gather(*(chat(client, body) for body in bodies))

    ttfa: dict[str, list[float]] = {name: [] for name in roots}
    try:
        for name, root in roots.items():
            port, log = free_port(), logs / f"{name}.log"
            cmd = [sys.executable, "-m", "omnistage.cli", "serve", "--model-path", str(model_dir), "--port", str(port),
                   "--no-playground", "--log-level", "debug", *default_server_args(concurrency, config, False)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(root.resolve())}
            proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
            servers[name] = (proc, port, log)
        for proc, port, log in servers.values():
            wait_healthy(proc, port, 600, log)
            asyncio.run(
                send(port, [request_body("image+text", 10**6, "ethan", 4, None)])
            )  # warm-up
        for b in range(bursts):
            for name, (_, port, _) in servers.items():
                bodies = [
                    request_body("image+text", b * concurrency + i, "ethan", 8, None)
                    for i in range(concurrency)
                ]
                results = asyncio.run(send(port, bodies))
                assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
                ttfa[name] += [r.ttfa_ms for r in results]
    finally:
        for proc, _, _ in servers.values():
            stop_server(proc)

    def stats(values: list[float]) -> dict:
        return {"p50": round(float(np.percentile(values, 50)), 1), "p99": round(float(np.percentile(values, 99)), 1),
                "mean": round(float(np.mean(values)), 1)}  # fmt: skip

    out = {}
    for name, (_, _, log) in servers.items():
        admitted = [float(m.group(1)) for m in ADMITTED_LINE.finditer(log.read_text())][
            1:
        ]  # not the warm-up
        assert len(admitted) == bursts * concurrency, (len(admitted), log)
        out[name] = {
            "admitted_ms": stats(admitted),
            "ttfa_ms": stats(ttfa[name]),
            "admitted_ms_all": admitted,
        }
    return out


def burst_table(results: dict[str, dict]) -> str:
    lines = ["| tree | admitted p50 | admitted p99 | admitted mean | TTFA p50 | TTFA p99 |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, r in results.items():
        a, t = r["admitted_ms"], r["ttfa_ms"]
        lines.append(
            f"| {name} | {a['p50']} | {a['p99']} | {a['mean']} | {t['p50']} | {t['p99']} |"
        )
    return "\n".join(lines)


def table(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [f"| step | {' | '.join(names)} |", f"| --- |{' ---: |' * len(names)}"]
    for kind in KINDS:
        lines.append(f"| **{kind}** |{' |' * len(names)}")
        for step in results[names[0]]["steps_cpu_ms"][kind]:
            cells = [
                f"{r['steps_cpu_ms'][kind].get(step, float('nan')):.2f}" for r in results.values()
            ]
            lines.append(f"| {step} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", nargs=2, action="append", metavar=("NAME", "ROOT"),
                        help="a source tree to measure (repeatable; default: this one, as 'this')")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=16, help="timed calls per step")
    parser.add_argument("--batch", type=int, default=8, help="prompts per encoder stage call")
    parser.add_argument("--burst", type=int, metavar="C",
                        help="measure the admitted phase of C image chats sent at once instead (module docstring)")  # fmt: skip
    parser.add_argument("--bursts", type=int, default=3, help="bursts per tree with --burst")
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--child", type=Path, help=argparse.SUPPRESS
    )  # a checkpoint: measure here, JSON to stdout
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.repeats, args.batch)))
        return
    configs = args.config or [("this", str(Path(__file__).resolve().parent.parent))]
    results = {}
    if args.burst is not None:
        with tempfile.TemporaryDirectory() as tmp:
            roots = {name: Path(root) for name, root in configs}
            results = bursts_of(roots, args.burst, args.bursts, Path(tmp))
        print(burst_table(results))
        if args.output:
            report = {"command": " ".join(sys.argv), "concurrency": args.burst, "bursts": args.bursts,
                      "cpu_count": os.cpu_count(), "configs": results}  # fmt: skip
            args.output.write_text(json.dumps(report, indent=2) + "\n")
        return
    from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(Path(tmp) / "qwen3_omni_tiny", "tiny", seed=0)
        for name, root in configs:
            env = {**os.environ, "PYTHONPATH": str(Path(root).resolve())}
            cmd = [sys.executable, __file__, "--child", str(checkpoint), "--repeats", str(args.repeats),
                   "--batch", str(args.batch)]  # fmt: skip
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(table(results))
    if args.output:
        report = {
            "command": " ".join(sys.argv),
            "repeats": args.repeats,
            "batch": args.batch,
            "configs": results,
        }
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
