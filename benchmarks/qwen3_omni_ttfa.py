"""Qwen3-Omni's time to first audio at concurrency 1, decomposed, for pipeline variants.

Runs the seven-stage pipeline in this process (no HTTP; the served benchmark is
``qwen3_omni_served.py``) at real dimensions with random weights drawn on the device
(``load_format="dummy"``; the config and a test tokenizer written to ``--model-dir``), one
variant after another on the same loaded weights (``stages.loaded_model`` caches them), and
sends each ``--requests`` spoken replies to the short text prompt one at a time (after
``--warmup`` requests that capture the graph variants they use). Per request it records the
pipeline's timeline marks (:mod:`omnistage.pipeline.timeline`: ``thinker.prefill``,
``thinker.first_output`` = the first reply token, ``talker.prefill`` = the talker's prefill
launched, ``talker.first_output`` = its first frame, ``code2wav.first_output``) and, in this
process, the host time of the talker's prompt build (``TalkerFeed._start``), of its prefill
launch, of the wait for its first frame and of code2wav's first decode; TTFA is the first
audio chunk at the pipeline's handle. Prints one table (p50 ms after receipt) and writes
JSON.

Variants (``--variants``): ``one_stream`` (as served: both engines on the stage threads'
current stream), ``talker_after_thinker`` (the talker starting only once the thinker is
done: its phases without the thinker decoding beside it), ``talker_process`` (talker and
code2wav in a process group of their own; its host marks are not recorded here).
``--concurrency N`` sends N requests at once per round (each variant is then also run at N,
``<variant>@N``).

A request that has not ended ``--stall-s`` seconds after it was sent stops its variant: the
stacks of every thread of this process go to ``<out>.<variant>.stacks.txt`` and each stage's
live state to the JSON (``stalled``), and the next variant runs.

Usage (device): ``python benchmarks/qwen3_omni_ttfa.py --out $OUT/qwen3_omni_ttfa.json``;
a CPU dry run: ``--size tiny --requests 2 --variants one_stream talker_process``. The
served benchmark's requests: ``--max-tokens 48 --frames 505`` (48 reply tokens, the talker
capped at 25 + 10 x 48 frames).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from omnistage.core.errors import OmnistageError
from omnistage.core.payloads import AudioChunk
from omnistage.engine.engine import AREngine
from omnistage.engine.vocoder_arena import StreamingDecoderArena
from omnistage.models.qwen3_omni import stages
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart
from omnistage.models.qwen3_omni.random_checkpoint import write_config
from omnistage.models.qwen3_omni.random_text_tokenizer import (
    give_role_words_their_ids,
    write_text_tokenizer,
)
from omnistage.models.qwen3_omni.request_builders import talker_sampling_of
from omnistage.pipeline.pipeline import Pipeline

TEXT_PROMPT = "What is the capital of France? Answer in one sentence."  # qwen3_omni_served.py's
VARIANTS = (
    "one_stream",
    "talker_after_thinker",
    "talker_process",
)
MARKS = (
    "admitted", "preprocessing.first_output", "thinker.prefill", "thinker.first_output",
    "talker.prompt_built", "talker.prefill", "talker.prefill_launched", "talker.first_frame_wait",
    "talker.first_output", "code2wav.decode_start", "code2wav.decode_end", "code2wav.first_output",
    "first_audio",
)  # fmt: skip

# host events in this process: (name, monotonic start, end)
EVENTS: list[tuple[str, float, float]] = []


def record(cls: type, attr: str, name: Callable[..., str | None]) -> None:
    """Wrap ``cls.attr`` to append ``(name(self, *args), start, end)`` when the name is not None."""
    original = getattr(cls, attr)

    def timed(self, *args, **kwargs):
        label = name(self, *args)
        start = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            if label is not None:
                EVENTS.append((label, start, time.monotonic()))

    setattr(cls, attr, timed)


def is_talker(engine: AREngine) -> bool:
    return isinstance(engine.runner.model, TalkerEngineModel)


def instrument() -> None:
    record(stages.TalkerFeed, "_start", lambda self, *a: "talker.prompt_built")
    record(AREngine, "_launch", lambda self, batch, *a: "talker.prefill_launched"
           if is_talker(self) and batch.kind == "prefill" else None)  # fmt: skip
    record(AREngine, "_resolve", lambda self, step: "talker.first_frame_wait"
           if is_talker(self) and all(not s.frames for s in step.seqs) else None)  # fmt: skip
    record(StreamingDecoderArena, "decode", lambda self, *a: "code2wav.decode")


def model_dir(size: str) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="omni_ttfa_"))
    write_config(directory, size)
    write_text_tokenizer(directory)
    give_role_words_their_ids(directory)
    return directory


def variant_config(path: Path, variant: str, max_num_seqs: int) -> Qwen3OmniPipelineConfig:
    start = 1 << 20 if variant == "talker_after_thinker" else 2  # 1 << 20: at the thinker's end
    config = Qwen3OmniPipelineConfig.for_model_path(
        str(path), load_format="dummy", talker_start_tokens=start
    )
    for name in ("thinker", "talker"):
        stage = config.stage(name)
        stage.factory.args = {**stage.factory.args, "max_num_seqs": max_num_seqs}
    config.stage("code2wav").factory.args = {
        **config.stage("code2wav").factory.args,
        "num_slots": max_num_seqs,
    }
    if variant == "talker_process":
        for name in ("talker", "code2wav"):
            config.stage(name).process = "speech"
    return config


def request(max_tokens: int, frames: int) -> Qwen3OmniRequest:
    messages = (ChatMessage("user", (ChatPart("text", text=TEXT_PROMPT),)),)
    sampling = OmniSampling()  # greedy, as the served benchmark's temperature 0
    return Qwen3OmniRequest(messages, True, "ethan", sampling, max_tokens, frames, stream=True,
                            talker_sampling=talker_sampling_of(sampling))  # fmt: skip


class Stalled(Exception):
    """A request did not end within ``--stall-s``."""


async def one_request(pipeline: Pipeline, max_tokens: int, frames: int) -> dict:
    """The request's marks, ms after its receipt (host events of this process within its
    life included: exact at concurrency 1, the first of any request's otherwise), or
    ``{"error": ...}`` when it failed."""
    handle = pipeline.submit(request(max_tokens, frames))
    first_audio = None
    try:
        async for chunk in handle.stream():
            if first_audio is None and isinstance(chunk.data, AudioChunk):
                first_audio = time.monotonic()
        await handle.result()
    except OmnistageError as exc:  # a failed request is counted, not a crash of the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    end = time.monotonic()
    origin = handle.timeline.marks[0][1]
    marks = {name: (at - origin) * 1e3 for name, at in handle.timeline.marks}
    marks["first_audio"] = (first_audio - origin) * 1e3 if first_audio is not None else float("nan")
    for name, start, stop in list(EVENTS):
        if start < origin or stop > end:
            continue
        if name == "code2wav.decode":
            marks.setdefault("code2wav.decode_start", (start - origin) * 1e3)
            marks.setdefault("code2wav.decode_end", (stop - origin) * 1e3)
        else:
            marks.setdefault(name, (stop - origin) * 1e3)  # the first one's end
    return marks


async def one_round(pipeline: Pipeline, args: argparse.Namespace, concurrency: int) -> list[dict]:
    EVENTS.clear()
    calls = [one_request(pipeline, args.max_tokens, args.frames) for _ in range(concurrency)]
    try:
        return await asyncio.wait_for(asyncio.gather(*calls), args.stall_s)
    except TimeoutError as exc:
        raise Stalled from exc


async def run_variant(path: Path, variant: str, concurrency: int, args: argparse.Namespace) -> dict:
    config = variant_config(path, variant, max(args.max_num_seqs, concurrency))
    name = variant if concurrency == 1 else f"{variant}@{concurrency}"
    row: dict = {"variant": name, "concurrency": concurrency}
    began = time.perf_counter()
    runs: list[dict] = []
    try:
        async with Pipeline(config) as pipeline:
            row["start_s"] = round(time.perf_counter() - began, 1)
            try:
                for _ in range(args.warmup):
                    await one_round(pipeline, args, 1)
                for _ in range(args.requests):
                    runs += await one_round(pipeline, args, concurrency)
            except Stalled:
                stacks = args.out.with_suffix(f".{name}.stacks.txt")
                with stacks.open("w") as f:
                    faulthandler.dump_traceback(f, all_threads=True)
                assert pipeline.host is not None
                row["stalled"] = {"after_requests": len(runs), "stacks": stacks.name,
                                  "live_state": {n: r.live_state() for n, r in pipeline.host.stages.items()}}  # fmt: skip
                print(f"{name}: stalled after {len(runs)} requests; stacks in {stacks}", flush=True)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row["failed"] = [r["error"] for r in runs if "error" in r]
    done = [r for r in runs if "error" not in r]
    if done:
        row["p50_ms_from_receipt"] = {
            m: round(statistics.median(r[m] for r in done), 1)
            for m in MARKS
            if all(m in r for r in done)
        }
        row["ttfa_ms"] = sorted(round(r["first_audio"], 1) for r in done)
    row["requests"] = runs
    return row


def print_table(rows: list[dict]) -> None:
    names = [row["variant"] + (" STALLED" if "stalled" in row else "") for row in rows]
    print(f"{'mark (p50 ms from receipt)':30}" + "".join(f"{n:>24}" for n in names))
    for mark in MARKS:
        cells = [row.get("p50_ms_from_receipt", {}).get(mark) for row in rows]
        print(f"{mark:30}" + "".join(f"{'-' if c is None else c:>24}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", default="30b-a3b", choices=["tiny", "30b-a3b"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--frames", type=int, default=40, help="talker frames at most per request")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument(
        "--concurrency", type=int, default=1, help="also run every variant at this concurrency"
    )
    parser.add_argument("--stall-s", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    instrument()
    path = model_dir(args.size)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "variants": []}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    levels = sorted({1, args.concurrency})
    for variant in args.variants:
        if variant == "talker_process":  # the thinker alone here: the shared load is dropped first
            stages.loaded_model.cache_clear()
        for concurrency in levels:
            row = asyncio.run(run_variant(path, variant, concurrency, args))
            result["variants"].append(row)
            print(row["variant"], json.dumps(row.get("p50_ms_from_receipt")), flush=True)
            args.out.write_text(json.dumps(result, indent=1))
    print_table(result["variants"])


if __name__ == "__main__":
    main()
