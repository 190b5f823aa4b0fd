#!/usr/bin/env python3
"""Benchmark the Qwen3-TTS speech tokenizer decoder as the streaming vocoder runs it.

The decoder has the real dimensions (114.3 M parameters) and random weights, built in
memory; it runs through :class:`StreamingDecoderArena` (64 state slots) exactly as the
vocoder stage calls it. Measures one chunk decode (median and p90 in ms, host-synchronized)
for 1, 8 and 64 concurrent streams (``--streams``) at chunk sizes 1 and 8 frames, eager vs CUDA graphs,
the first 1-frame chunk of a fresh stream at concurrency 1 (slot allocation included), and
opening one stream with an unseen 3 s reference as left context (38 frames: eager; graph
replays of 32 + 6 frames, the Qwen3-TTS vocoder's; replays of chunks of at most 8 frames).
Audio throughput = streams x chunk x 80 ms per call time. ``--op-shapes N`` adds the ``N``
convolution ops with the most device time (CPU time on a CPU) by input shapes, the kernels
under them included, from one eager decode of ``--op-shapes-streams`` (128) x 8 frames under
``torch.profiler``: a slow cuDNN kernel in ``gpu_share.py``'s table traced to its layer (JSON
key ``op_shapes``). ``--layouts ncl cl`` measures all of it for the decoder in ``[B, C, L]``
(``ncl``, the default and the only one unless asked) and channels-last (``cl``:
``CarriedStateVocoder.to_channels_last``), one after the other in the same process: the
rows and op shapes carry ``"layout"``, and the channels-last entries of ``first_chunk`` and
``context_open`` are the mode followed by ``", channels-last"``. Prints a table and writes
JSON (default benchmarks/results/vocoder_gpu.json).
About a minute on an H200 per layout.

Usage: python benchmarks/vocoder_gpu.py [--streams 1 8 64] [--dtype bfloat16|float32] [--layouts ncl cl] [--op-shapes 12 [--op-shapes-streams 128]] [--output PATH]
       python benchmarks/vocoder_gpu.py --device cpu --size tiny --iters 3 --layouts ncl cl --output /tmp/v.json  (smoke test)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omnistage.engine.vocoder_arena import (
    DEFAULT_GRAPH_CHUNK_LENGTHS,
    DEFAULT_GRAPH_CONTEXT_LENGTHS,
    StreamingDecoderArena,
)
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import SpeechTokenizerConfig
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import build_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    random_speech_tokenizer_tensors,
    speech_tokenizer_config,
)

FRAME_S = 0.08
CONCURRENCY = (1, 8, 64)
CHUNKS = (1, 8)
CONTEXT_FRAMES = 38  # a 3 s reference clip: ceil(72000 samples / 1920 per frame)
LAYOUTS = {"ncl": "", "cl": ", channels-last"}  # layout -> its suffix of first_chunk / context_open keys


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:  # noqa: ANN001 -- any callable
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def chunk_times(arena: StreamingDecoderArena, streams: int, frames: int, iters: int) -> list[float]:
    device = arena.device
    slots = [arena.allocate() for _ in range(streams)]
    codes = torch.randint(0, 2048, (streams, frames, 16), device=device)
    for _ in range(3):
        arena.decode(slots, codes)
    times = [timed(device, lambda: arena.decode(slots, codes)) for _ in range(iters)]
    for slot in slots:
        arena.free(slot)
    return times


def first_chunk_ms(arena: StreamingDecoderArena, iters: int) -> list[float]:
    device = arena.device
    codes = torch.randint(0, 2048, (1, 1, 16), device=device)
    times = []
    for _ in range(iters):
        def first() -> None:
            slot = arena.allocate()
            arena.decode([slot], codes)
            arena.free(slot)
        times.append(timed(device, first))
    return times


def context_open_ms(arena: StreamingDecoderArena, iters: int) -> list[float]:
    """Opening one stream with an unseen left context (host codes, as the stage gets them;
    a new one each time, so it is decoded, not copied from the cache), until the device
    is done."""
    times = []
    for i in range(iters):
        context = torch.randint(0, 2048, (CONTEXT_FRAMES, 16), generator=torch.Generator().manual_seed(i))
        times.append(timed(arena.device, lambda c=context: arena.free(arena.allocate(c))))
    return times


CONV_OP = "aten::convolution"  # under conv1d / conv2d and the transposed ones alike


def op_shapes(arena: StreamingDecoderArena, streams: int, frames: int, top: int) -> list[dict[str, object]]:
    """The ``top`` convolutions (:data:`CONV_OP`; a weight ``[C_in, C_out, K]`` is a transposed
    one's; channels-last, inputs are ``[B, C, 1, L]``, or ``[B, C, L / d, d]`` by phases, and
    weights 4-D likewise) of one decode of ``streams`` x ``frames`` in ``arena`` (one without graphs: an
    eager decode, the kernels its graphs would hold), by device time (CUDA; CPU time on a
    CPU), grouped by input shapes (weight and bias shapes included). An op's time includes
    the kernels it launched."""
    device = arena.device
    slots = [arena.allocate() for _ in range(streams)]
    codes = torch.randint(0, 2048, (streams, frames, 16), device=device)
    arena.decode(slots, codes)  # warm: kernel selection, workspaces
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        arena.decode(slots, codes)
        sync(device)
    for slot in slots:
        arena.free(slot)
    rows = [r for r in prof.key_averages(group_by_input_shape=True) if r.key == CONV_OP]

    def cost(r) -> float:  # noqa: ANN001 -- a profiler row
        return r.device_time_total if device.type == "cuda" else r.cpu_time_total
    return [{"op": r.key, "shapes": str(r.input_shapes), "calls": r.count, "ms": cost(r) / 1e3}
            for r in sorted(rows, key=cost, reverse=True)[:top]]  # fmt: skip


def summary(times: list[float]) -> dict[str, float]:
    """Median and 90th percentile (linear between samples, so never below the median)."""
    p90 = statistics.quantiles(times, n=10, method="inclusive")[-1] if len(times) > 1 else times[0]
    return {"median_ms": statistics.median(times), "p90_ms": p90}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="0.6b", choices=["tiny", "0.6b"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--streams", type=int, nargs="+", default=list(CONCURRENCY),
                        help="concurrent streams of the chunk rows (and the graphs' batch buckets)")  # fmt: skip
    parser.add_argument("--layouts", nargs="+", default=["ncl"], choices=list(LAYOUTS),
                        help="the decoder's activation layouts to measure, in order (cl: channels-last)")  # fmt: skip
    parser.add_argument("--op-shapes", type=int, default=0, metavar="N", help="the N costliest conv ops by input shapes")
    parser.add_argument("--op-shapes-streams", type=int, default=128,
                        help="streams of the --op-shapes decode (cuDNN picks kernels by batch)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results/vocoder_gpu.json")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config(args.size))
    tensors = random_speech_tokenizer_tensors(args.size, seed=0)
    modes = ["eager", "graphs"] if device.type == "cuda" else ["eager"]
    rows, firsts, contexts, convs = [], {}, {}, []
    for layout in args.layouts:
        decoder = build_decoder(config.decoder, tensors, device, dtype)
        if layout == "cl":
            decoder.to_channels_last()
        suffix = LAYOUTS[layout]
        for mode in modes:
            arena = StreamingDecoderArena(decoder, num_slots=max(args.streams))
            if mode == "graphs":
                capture = partial(arena.capture_graphs, args.streams, DEFAULT_GRAPH_CHUNK_LENGTHS, DEFAULT_GRAPH_CONTEXT_LENGTHS)
                capture_ms = timed(device, capture)
                print(f"{layout}: captured {len(arena._graphs)} graphs in {capture_ms:.0f} ms")
            firsts[mode + suffix] = summary(first_chunk_ms(arena, args.iters))
            contexts[mode + suffix] = summary(context_open_ms(arena, args.iters))
            if mode == "graphs":  # the same without the context lengths: chunks of at most 8
                short = StreamingDecoderArena(decoder, num_slots=1)
                short.capture_graphs((1,), DEFAULT_GRAPH_CHUNK_LENGTHS)
                contexts["graphs, chunks <= 8" + suffix] = summary(context_open_ms(short, args.iters))
            for streams in args.streams:
                for frames in CHUNKS:
                    stats = summary(chunk_times(arena, streams, frames, args.iters))
                    audio_s = streams * frames * FRAME_S
                    rows.append({"layout": layout, "mode": mode, "streams": streams, "chunk_frames": frames, **stats,
                                 "audio_s_per_wall_s": audio_s / (stats["median_ms"] / 1e3)})  # fmt: skip
        if args.op_shapes:
            streams = args.op_shapes_streams
            arena = StreamingDecoderArena(decoder, num_slots=streams)
            convs += [{"layout": layout, **c} for c in op_shapes(arena, streams, max(CHUNKS), args.op_shapes)]

    print(f"{'layout':6} {'mode':7} {'streams':>7} {'chunk':>5} {'median ms':>10} {'p90 ms':>8} {'audio s/s':>10}")
    for r in rows:
        print(f"{r['layout']:6} {r['mode']:7} {r['streams']:7d} {r['chunk_frames']:5d} {r['median_ms']:10.2f} "
              f"{r['p90_ms']:8.2f} {r['audio_s_per_wall_s']:10.1f}")  # fmt: skip
    for mode, stats in firsts.items():
        print(f"first 1-frame chunk, 1 stream, {mode}: median {stats['median_ms']:.2f} ms, p90 {stats['p90_ms']:.2f} ms")
    for mode, stats in contexts.items():
        print(f"open with an unseen {CONTEXT_FRAMES}-frame left context, {mode}: median {stats['median_ms']:.2f} ms, "
              f"p90 {stats['p90_ms']:.2f} ms")  # fmt: skip
    if args.op_shapes:
        print(f"\nconv ops of one eager decode of {args.op_shapes_streams} streams x {max(CHUNKS)} frames "
              "(layout, ms, calls, op, input shapes)")  # fmt: skip
        for c in convs:
            print(f"{c['layout']:6} {c['ms']:8.3f} {c['calls']:4d}  {c['op']}  {c['shapes']}")
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "size": args.size, "dtype": args.dtype, "iters": args.iters, "layouts": args.layouts,
        "chunks": rows, "first_chunk": firsts, "context_open": contexts, "context_frames": CONTEXT_FRAMES,
        **({"op_shapes": convs} if args.op_shapes else {}),
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
