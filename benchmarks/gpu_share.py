#!/usr/bin/env python3
"""The AR engine and the streaming vocoder sharing one GPU: alone, together, and where
their device time goes (issue 15: served Qwen3-TTS at c=128 runs near the sum of the two,
not the larger).

Both at the real 0.6B sizes with random weights, bf16, CUDA graphs on: the engine is the
toy talker of ``engine_gpu.py`` (28-layer talker, 15 code-predictor sub-steps) with
``--batch`` requests decoding (no prefills: none ends in the window); the vocoder is the
speech tokenizer decoder in a :class:`StreamingDecoderArena` of ``--batch`` slots with the
serving graphs, decoding ``--vocoder-streams`` streams x 8 frames a call (16 x 8 = the
128 frames one engine step at batch 128 makes, as the vocoder stage batches due chunks).

Measured for ``--window-s`` seconds each, in this order: the engine alone (steps per s),
the vocoder alone (calls per s), then both at once from two threads of this process (as
``omnistage serve`` runs them: the engine's loop and the vocoder stage's), once with the
engine on the caller's (default) stream and once on a stream of its own
(``EngineConfig.own_stream``). ``overlap`` = (engine share + vocoder share) where a share
is the rate together over the rate alone: 1.0 means the two only take turns on the GPU,
2.0 means neither slows the other. Then a kernel table per side from ``torch.profiler``
(CUDA time per kernel name, the top ``--top``). Prints tables and writes JSON (default
benchmarks/results/gpu_share.json). About two minutes on an H200.

``--layouts ncl cl`` runs the vocoder's side in each activation layout (``ncl``: ``[B, C,
L]``, the default and the only one unless asked; ``cl``: channels-last,
``CarriedStateVocoder.to_channels_last``), an arena with its graphs per layout: the vocoder
alone per layout, and per engine stream, the engine alone once and both together once per
layout. ``runs`` rows carry ``"layout"``; a channels-last run's vocoder tables and times are
under the keys with ``_channels_last`` appended (``vocoder_kernels_channels_last``, ...).

Usage: python benchmarks/gpu_share.py [--batch 128] [--vocoder-streams 16] [--layouts ncl cl] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.vocoder_arena import DEFAULT_GRAPH_CHUNK_LENGTHS, StreamingDecoderArena
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import SpeechTokenizerConfig
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import build_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    random_speech_tokenizer_tensors,
    speech_tokenizer_config,
)
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import request  # noqa: E402 -- the same requests as the engine benchmark
from profiling import kernel_table  # noqa: E402

CHUNK = 8  # frames per vocoder call and stream: the steady chunk of the serving plan
LAYOUTS = {"ncl": "", "cl": "_channels_last"}  # layout -> its suffix of the vocoder's report keys


def vocode(arena: StreamingDecoderArena, slots: list[int], codes: torch.Tensor) -> None:
    """One vocoder call: ``codes`` (host) for ``slots``, every stream kept inside the
    transformer's positions forever."""
    for slot in slots:
        arena._frames[slot] = 0
    arena.decode(slots, codes)


def call_until(stop: threading.Event, fn, rates: dict[str, float]) -> None:  # noqa: ANN001 -- any callable
    """Call ``fn`` until ``stop`` is set (a thread's loop); its calls per second (device-
    synchronized at the end) into ``rates["vocoder"]``."""
    calls, start = 0, time.perf_counter()
    while not stop.is_set():
        fn()
        calls += 1
    torch.cuda.synchronize()
    rates["vocoder"] = calls / (time.perf_counter() - start)


def run_for(window_s: float, fn) -> float:  # noqa: ANN001 -- any callable
    """Calls of ``fn`` per second over ``window_s`` (device-synchronized at both ends)."""
    torch.cuda.synchronize()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < window_s:
        fn()
        calls += 1
    torch.cuda.synchronize()
    return calls / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--vocoder-streams", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--layouts", nargs="+", default=["ncl"], choices=list(LAYOUTS),
                        help="the vocoder's activation layouts to measure, in order (cl: channels-last)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results/gpu_share.json")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = ToyARConfig.qwen3_tts_0b6()
    model = ToyTalker(config, dtype, device)
    st_config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config("0.6b"))
    tensors = random_speech_tokenizer_tensors("0.6b", seed=0)
    codes = torch.randint(0, 2048, (args.vocoder_streams, CHUNK, 16))  # host codes, as the stage gets them
    arenas, slots, vocoders = {}, {}, {}  # per layout: its arena, its streams, a call of them
    for layout in args.layouts:
        decoder = build_decoder(st_config.decoder, tensors, device, dtype)
        if layout == "cl":
            decoder.to_channels_last()
        arena = arenas[layout] = StreamingDecoderArena(decoder, num_slots=args.batch)
        arena.capture_graphs(chunk_lengths=DEFAULT_GRAPH_CHUNK_LENGTHS)
        slots[layout] = arena.allocate_many([None] * args.vocoder_streams)
        vocoders[layout] = partial(vocode, arena, slots[layout], codes)

    report: dict[str, object] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                 "batch": args.batch, "vocoder_streams": args.vocoder_streams,
                                 "chunk_frames": CHUNK, "window_s": args.window_s, "layouts": args.layouts,
                                 "runs": []}  # fmt: skip
    vocoder_alone = {}
    for layout, vocoder in vocoders.items():
        vocoder_alone[layout] = run_for(args.window_s, vocoder)
        print(f"vocoder alone, {layout}: {1e3 / vocoder_alone[layout]:.2f} ms a call", flush=True)
    for own_stream in (False, True):
        engine = AREngine(model, EngineConfig(
            kv_cache_bytes=20 << 30, max_num_seqs=args.batch, max_model_len=1200, max_prefill_tokens=128 * args.batch,
            prefill_hold_ms=0.0, num_step_rows=16 * args.batch, cuda_graph_batch_sizes=(args.batch,),
            own_stream=own_stream))
        for i in range(args.batch):
            engine.add_request(f"r{i}", request(config, device, dtype, i, 1000))
        for _ in range(2 * args.batch):  # admission takes a few prefill steps; never forever
            if not (engine.scheduler.waiting or any(s.num_scheduled == 0 for s in engine.scheduler.running)):
                break
            engine.step()
        else:
            raise RuntimeError(f"{len(engine.scheduler.waiting)} of {args.batch} requests never started (KV pool too small?)")
        engine_alone = run_for(args.window_s, engine.step)
        for layout, vocoder in vocoders.items():
            stop, rates = threading.Event(), {}
            thread = threading.Thread(target=call_until, args=(stop, vocoder, rates))
            thread.start()
            try:
                rates["engine"] = run_for(args.window_s, engine.step)
            finally:
                stop.set()
                thread.join()
            run = {"layout": layout, "engine_own_stream": own_stream, "engine_steps_per_s_alone": engine_alone,
                   "vocoder_calls_per_s_alone": vocoder_alone[layout], "engine_steps_per_s_together": rates["engine"],
                   "vocoder_calls_per_s_together": rates["vocoder"],
                   "overlap": rates["engine"] / engine_alone + rates["vocoder"] / vocoder_alone[layout]}  # fmt: skip
            report["runs"].append(run)
            print(run, flush=True)
        if not own_stream:
            report["engine_kernels"] = kernel_table(engine.step, args.top)
        for request_id in list(engine.live_requests()):
            engine.abort(request_id)
        while engine.has_work():
            engine.step()
        del engine
    wide_codes = torch.randint(0, 2048, (args.batch, CHUNK, 16))
    for layout, arena in arenas.items():
        suffix = LAYOUTS[layout]
        report["vocoder_kernels" + suffix] = kernel_table(vocoders[layout], args.top)
        every = slots[layout] + arena.allocate_many([None] * (args.batch - args.vocoder_streams))
        vocode_all = partial(vocode, arena, every, wide_codes)
        report["vocoder_all_streams_ms" + suffix] = 1e3 / run_for(args.window_s / 2, vocode_all)
        report["vocoder_all_kernels" + suffix] = kernel_table(vocode_all, args.top)

    print(f"\nbatch {args.batch}; vocoder {args.vocoder_streams} streams x {CHUNK} frames a call")
    print(f"{'layout':>6} {'engine stream':>14} {'engine ms/step alone':>21} {'together':>9} {'vocoder ms/call alone':>22} "
          f"{'together':>9} {'overlap':>8}")  # fmt: skip
    for r in report["runs"]:
        print(f"{r['layout']:>6} {'own' if r['engine_own_stream'] else 'default':>14} {1e3 / r['engine_steps_per_s_alone']:>21.2f} "
              f"{1e3 / r['engine_steps_per_s_together']:>9.2f} {1e3 / r['vocoder_calls_per_s_alone']:>22.2f} "
              f"{1e3 / r['vocoder_calls_per_s_together']:>9.2f} {r['overlap']:>8.2f}")  # fmt: skip
    for layout in arenas:
        ms = report["vocoder_all_streams_ms" + LAYOUTS[layout]]
        print(f"vocoder, {layout}, all {args.batch} streams x {CHUNK} frames: {ms:.2f} ms a call")
    tables = ["engine_kernels", *(f"{name}{LAYOUTS[layout]}" for layout in arenas
                                  for name in ("vocoder_kernels", "vocoder_all_kernels"))]  # fmt: skip
    for name in tables:
        print(f"\n{name} (ms per call, launches per call, share)")
        for row in report[name]:
            print(f"{row['ms_per_call']:8.3f} {row['launches_per_call']:7.0f} {row['share']:6.1%}  {row['kernel']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
