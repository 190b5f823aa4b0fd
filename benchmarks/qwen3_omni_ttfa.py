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
current stream), ``own_streams`` (each engine on a CUDA stream of its own: the stages'
``own_stream``), ``talker_after_thinker`` (the talker starting only once the thinker is
done: its phases without the thinker decoding beside it), ``talker_process`` (talker and
code2wav in a process group of their own; its host marks are not recorded here).
``--concurrency N`` sends N requests at once per round (each variant is then also run at N,
``<variant>@N``).

A request that has not ended ``--stall-s`` seconds after it was sent stops its variant: the
stacks of every thread of this process go to ``<out>.<variant>.stacks.txt`` and each stage's
live state to the JSON (``stalled``), and the next variant runs.

``--sync-debug`` (CUDA): torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``)
during the timed requests, and every synchronizing CUDA call it warns of counted per call site
(the innermost omnistage frames of its stack), thread and host event it ran in (the talker's
prompt build, its prefill launch, ...; ``other`` outside them): a table of the top sites per
variant and ``sync_debug`` in its JSON row. Each warning costs a stack walk, so the marks of
such a run are slower than without it. On CPU the mode does nothing; the run says so.

Usage (device): ``python benchmarks/qwen3_omni_ttfa.py --out $OUT/qwen3_omni_ttfa.json``;
a CPU dry run: ``--size tiny --requests 2 --variants one_stream talker_process``. The
served benchmark's requests: ``--max-tokens 48 --frames 505`` (48 reply tokens, the talker
capped at 25 + 10 x 48 frames).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import functools
import gc
import json
import statistics
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import omnistage
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
    "own_streams",
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
# the host event running on this thread (its ``name``), for --sync-debug's phases
CURRENT_EVENT = threading.local()


def record(cls: type, attr: str, name: Callable[..., str | None]) -> None:
    """Wrap ``cls.attr`` to append ``(name(self, *args), start, end)`` when the name is not None."""
    original = getattr(cls, attr)

    def timed(self, *args, **kwargs):
        label = name(self, *args)
        outer = getattr(CURRENT_EVENT, "name", None)
        if label is not None:
            CURRENT_EVENT.name = label
        start = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            if label is not None:
                EVENTS.append((label, start, time.monotonic()))
                CURRENT_EVENT.name = outer

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


#: torch's warning at a synchronizing CUDA call in sync debug mode (c10/cuda/CUDAFunctions.cpp)
SYNC_WARNING = "called a synchronizing CUDA operation"
PACKAGE_DIR = Path(omnistage.__file__).resolve().parent
SITE_FRAMES = 3  # omnistage frames that name a call site, innermost first
TOP_SITES = 30


@functools.cache
def package_path(filename: str) -> str | None:
    """``omnistage/...`` for a file of the omnistage package, else None."""
    path = Path(filename).resolve()
    return str(path.relative_to(PACKAGE_DIR.parent)) if path.is_relative_to(PACKAGE_DIR) else None


class SyncLog:
    """Synchronizing CUDA calls counted by (thread name, host event, call site): the call
    site is the innermost :data:`SITE_FRAMES` omnistage frames of the stack that warned (the
    warning hook runs in the thread that made the call), the host event :data:`CURRENT_EVENT`
    (``other`` outside the recorded ones).

    What the mode sees (c10's ``warn_or_error_on_sync``): copies that wait for the stream
    (``.item()``, ``.tolist()``, ``.cpu()``, a blocking host-to-device copy such as
    ``torch.tensor(..., device="cuda")`` or a 0-d ``t[i] = x``), ``nonzero`` and boolean-mask
    indexing, stream synchronizes. Not ``torch.cuda.synchronize()``, ``Event.synchronize()``
    (the engine's wait for a step's frames) or non-blocking copies from pageable memory."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str, tuple[str, ...]]] = Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Sync debug mode on, its warnings counted instead of shown (every one: the
        ``always`` filter; the default shows a line's first only)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=SYNC_WARNING)
            shown = warnings.showwarning

            def hook(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING in str(message):
                    self._count()
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")

    def _count(self) -> None:
        named = [(package_path(f.filename), f) for f in traceback.extract_stack()]
        inner = [f"{path}:{f.lineno} {f.name}" for path, f in named if path][-SITE_FRAMES:][::-1]
        event = getattr(CURRENT_EVENT, "name", None) or "other"
        key = (threading.current_thread().name, event, tuple(inner) or ("(no omnistage frame)",))
        with self._lock:
            self.calls[key] += 1

    def summary(self, requests: int) -> dict:
        """Totals per host event and thread, and every (thread, event, site) with its count,
        most first (``requests``: the timed requests they came from)."""
        by_event: Counter[str] = Counter()
        by_thread: Counter[str] = Counter()
        for (thread, event, _), count in self.calls.items():
            by_event[event] += count
            by_thread[thread] += count
        sites = [{"count": count, "thread": thread, "event": event, "stack": list(site)}
                 for (thread, event, site), count in self.calls.most_common()]  # fmt: skip
        return {"requests": requests, "calls": sum(self.calls.values()), "by_event": dict(by_event.most_common()),
                "by_thread": dict(by_thread.most_common()), "sites": sites}  # fmt: skip


def print_sync_table(name: str, summary: dict) -> None:
    per = max(summary["requests"], 1)
    print(f"{name}: {summary['calls']} synchronizing CUDA calls in {summary['requests']} requests; by host event: "
          + ", ".join(f"{e} {c}" for e, c in summary["by_event"].items()))  # fmt: skip
    print(f"{'count':>6} {'/req':>6}  {'thread':16} {'host event':24} call site (innermost first)")
    for site in summary["sites"][:TOP_SITES]:
        print(f"{site['count']:>6} {site['count'] / per:>6.1f}  {site['thread']:16} {site['event']:24} "
              + " < ".join(site["stack"]))  # fmt: skip


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
        stage.factory.args = {**stage.factory.args, "max_num_seqs": max_num_seqs,
                              "own_stream": variant == "own_streams"}  # fmt: skip
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
    syncs = SyncLog() if args.sync_debug and torch.cuda.is_available() else None
    try:
        async with Pipeline(config) as pipeline:
            row["start_s"] = round(time.perf_counter() - began, 1)
            try:
                for _ in range(args.warmup):
                    await one_round(pipeline, args, 1)
                with syncs.recording() if syncs is not None else contextlib.nullcontext():
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
    if syncs is not None:
        row["sync_debug"] = syncs.summary(len(runs))
        print_sync_table(name, row["sync_debug"])
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
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="count synchronizing CUDA calls per call site (CUDA only)",
    )
    args = parser.parse_args()
    if args.sync_debug and not torch.cuda.is_available():
        print("--sync-debug: sync debugging needs CUDA (torch's sync debug mode does nothing on CPU); "
              "nothing is recorded", flush=True)  # fmt: skip
    torch.set_grad_enabled(False)
    instrument()
    path = model_dir(args.size)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "variants": []}  # fmt: skip
    if args.sync_debug and not torch.cuda.is_available():
        result["sync_debug"] = "needs CUDA: nothing recorded"
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
