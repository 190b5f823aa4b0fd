#!/usr/bin/env python3
"""Benchmark the AR engine at the real Qwen3-TTS 0.6B sizes with random weights.

The model is the toy talker (:mod:`omnistage.testing.toy_ar`) scaled up: talker 28 Qwen3
layers (hidden 1024, 16 heads, 8 kv heads, head_dim 128, intermediate 3072, vocab 3072),
code predictor 5 layers with 15 sub-steps over 2048 codes, bf16. Sampling as Qwen3-TTS
serves it: top-k 50, T 0.9, repetition penalty 1.05 (code 0; EOS never sampled, codes
2048..3071 suppressed), predictor top-k 50, T 0.9.

Measures, on CUDA: the frame step time (talker + code predictor + sampling, the engine's
own loop, host overlap on) at batch 1, 8, 32, 64, 128, eager vs CUDA graphs; frames and
audio seconds per wall second (80 ms per frame); the prefill step (the prefill and the
first frame, launch to frames on the host) of one 100-token prompt, and of a 14-token
suffix after a 96-token prefix that is a prefix-cache hit (a known voice's prompt), in
three modes: ``eager`` (no graphs), ``tail_graphs`` (decode steps and prefill tails
replayed, the prefill's forward eager: ``cuda_graph_prefill_tokens=()``) and
``cuda_graphs`` (the defaults: small prefills replayed too). Then the served load without
the server (``closed_loop``): ``batch`` streams of ``CLOSED_LOOP_FRAMES`` frames in a closed
loop (a stream that ends is replaced before the next step by a known voice's request: the
cached prefix and ``SUFFIX_LEN`` new rows; their lengths staggered at the start, so about
``batch / CLOSED_LOOP_FRAMES`` streams end and start a step), with the engine's overlap
off and on (``EngineConfig.overlap``: the next step launched before a step's frames are
read, a prefill step also decoding the running streams: one mixed step, one frame tail over
the running streams' rows and the newcomers'), in the ``cuda_graphs`` mode: frames and
audio seconds per wall second, and the share of prefill steps (with overlap: mixed steps).
``--closed-loop-only`` runs the closed loop alone (``--loop-batches`` its batches).
Prints a table and writes JSON (default benchmarks/results/engine_gpu.json).

Usage: python benchmarks/engine_gpu.py [--output PATH] [--closed-loop-only] [--loop-batches 64 128]
       python benchmarks/engine_gpu.py --device cpu --tiny --output /tmp/engine.json  (smoke test)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

FRAME_S = 0.08  # one frame = 80 ms of audio (12.5 Hz)
PROMPT_LEN = 100
PREFIX_LEN, SUFFIX_LEN = 96, 14  # a known voice: 6 cached blocks of 16, then its text
CLOSED_LOOP_FRAMES = 125  # frames per closed-loop stream, as benchmarks/qwen3_tts_gpu.py serves them


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def request(config: ToyARConfig, device: torch.device, dtype: torch.dtype, seed: int, max_new: int,
            prefix: torch.Tensor | None = None) -> GenerationInput:
    """A random ``PROMPT_LEN``-row prompt, or ``prefix`` then ``SUFFIX_LEN`` random rows
    (with ``cache_prompt``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = config.hidden_size
    sampling = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=seed,
                              suppress_ranges=((min(2048, config.vocab_size - 1), config.vocab_size),))
    rows = torch.randn(PROMPT_LEN if prefix is None else SUFFIX_LEN, h, generator=g, device=device, dtype=dtype)
    return GenerationInput(
        rows if prefix is None else torch.cat([prefix, rows]), sampling, max_new,
        step_rows=torch.randn(8, h, generator=g, device=device, dtype=dtype),
        pad_embed=torch.randn(h, generator=g, device=device, dtype=dtype),
        predictor_sampling=SamplingParams(temperature=0.9, top_k=50, seed=seed + 1),
        cache_prompt=prefix is not None,
    )


def frame_step_ms(engine: AREngine, model: ToyTalker, batch: int, warmup: int, steps: int) -> float:
    """Mean engine step time with ``batch`` requests decoding (after their prefill)."""
    spec = model.spec
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", request(model.c, spec.device, spec.dtype, i, warmup + steps + 4))
    while any(s.num_scheduled == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(warmup):
        engine.step()
    sync(spec.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(spec.device)
    elapsed = time.perf_counter() - start
    for request_id in list(engine.live_requests()):
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    return 1000 * elapsed / steps


def prefill_ms(engine: AREngine, model: ToyTalker, runs: int, prefix: torch.Tensor | None = None) -> float:
    """Median time of one prefill step of a single prompt (launch to its first frame on the
    host): ``PROMPT_LEN`` rows, or with ``prefix`` its ``SUFFIX_LEN`` rows after the
    cached prefix (a first request caches it; every measured one must hit it)."""
    spec, times = model.spec, []
    if prefix is not None:
        engine.add_request("cache-prefix", request(model.c, spec.device, spec.dtype, 999, 2, prefix))
        while engine.has_work():
            engine.step()
    for run in range(runs):
        hits = engine.prefix_hit_tokens
        engine.add_request(f"p{run}", request(model.c, spec.device, spec.dtype, 1000 + run, 2, prefix))
        sync(spec.device)
        start = time.perf_counter()
        engine.step()
        sync(spec.device)
        times.append(1000 * (time.perf_counter() - start))
        if prefix is not None and engine.prefix_hit_tokens - hits != PREFIX_LEN:
            raise RuntimeError(f"the prefix was not a cache hit ({engine.prefix_hit_tokens - hits} tokens)")
        engine.abort(f"p{run}")
        while engine.has_work():
            engine.step()
    return statistics.median(times)


def closed_loop(engine: AREngine, model: ToyTalker, batch: int, frames: int, steps: int,
                prefix: torch.Tensor) -> dict[str, float]:
    """``batch`` streams in a closed loop for ``steps`` engine steps (see the module
    docstring): stream ``i`` of the first ``batch`` has ``frames - i * frames // batch``
    frames, every later one ``frames``. Returns frames and audio seconds per wall second,
    ms per step and the share of steps that were prefills."""
    spec, started = model.spec, 0

    def start(max_new: int) -> None:
        nonlocal started
        engine.add_request(f"loop{batch}-{started}", request(model.c, spec.device, spec.dtype, 3000 + started,
                                                             max_new, prefix))
        started += 1

    engine.add_request("cache-prefix", request(model.c, spec.device, spec.dtype, 999, 2, prefix))
    while engine.has_work():
        engine.step()
    for i in range(batch):
        start(max(1, frames - i * frames // batch))
    made = prefills = 0
    sync(spec.device)
    begin = time.perf_counter()
    for _ in range(steps):
        plan = engine.schedule()
        prefills += plan.batch is not None and plan.batch.kind == "prefill"
        for out in engine.execute(plan):
            made += out.frame is not None
            if out.result is not None:
                start(frames)
    sync(spec.device)
    elapsed = time.perf_counter() - begin
    for request_id in list(engine.live_requests()):
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    return {"frames_per_s": made / elapsed, "audio_s_per_s": made / elapsed * FRAME_S,
            "ms_per_step": 1000 * elapsed / steps, "prefill_step_share": prefills / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny toy sizes (a smoke test)")
    parser.add_argument("--output", default="benchmarks/results/engine_gpu.json")
    parser.add_argument("--closed-loop-only", action="store_true", help="skip the frame steps and prefills")
    parser.add_argument("--loop-batches", type=int, nargs="+", help="closed-loop batches (default: those >= 8)")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    config = ToyARConfig() if args.tiny else ToyARConfig.qwen3_tts_0b6()
    dtype = torch.bfloat16 if on_cuda else torch.float32
    batches = [1, 8, 32, 64, 128] if not args.tiny else [1, 4, 8]
    warmup, steps = (5, 30) if on_cuda else (1, 3)
    started = time.perf_counter()
    model = ToyTalker(config, dtype, device)
    engine_args = dict(kv_cache_bytes=(8 << 30) if on_cuda else (16 << 20), max_num_seqs=max(batches),
                       max_model_len=512, max_prefill_tokens=PROMPT_LEN * max(batches), prefill_hold_ms=0.0,
                       num_step_rows=16 * max(batches))
    # mode: (decode and tail buckets, prefill buckets (None: the defaults), frame steps measured)
    all_modes = {"eager": ((), (), True), "tail_graphs": (tuple(batches), (), False),
                 "cuda_graphs": (tuple(batches), None, True)}
    modes = all_modes if on_cuda else {"eager": all_modes["eager"]}
    loop_mode = "cuda_graphs" if on_cuda else "eager"
    loop_sizes, loop_prefill_tokens, _ = modes[loop_mode]
    if args.closed_loop_only:
        modes = {}
    prefix = torch.randn(PREFIX_LEN, config.hidden_size, generator=torch.Generator(device=device).manual_seed(7),
                         device=device, dtype=dtype)
    rows: dict[str, dict[int, float]] = {}
    prefill: dict[str, float] = {}
    prefill_suffix: dict[str, float] = {}
    for mode, (sizes, prefill_tokens, frame_steps) in modes.items():
        built = time.perf_counter()
        engine = AREngine(model, EngineConfig(**engine_args, cuda_graph_batch_sizes=sizes,
                                              cuda_graph_prefill_tokens=prefill_tokens))
        print(f"{mode}: engine built in {time.perf_counter() - built:.1f} s", flush=True)
        prefill[mode] = prefill_ms(engine, model, runs=5 if on_cuda else 1)
        prefill_suffix[mode] = prefill_ms(engine, model, runs=9 if on_cuda else 1, prefix=prefix)
        if frame_steps:
            rows[mode] = {b: frame_step_ms(engine, model, b, warmup, steps) for b in batches}
        del engine
    loop_batches = args.loop_batches or [b for b in batches if b >= 8]
    loop_frames, loop_steps = (CLOSED_LOOP_FRAMES, 300) if on_cuda else (12, 6)
    closed: list[dict[str, object]] = []
    for overlap in (False, True):
        engine = AREngine(model, EngineConfig(**engine_args, cuda_graph_batch_sizes=loop_sizes,
                                              cuda_graph_prefill_tokens=loop_prefill_tokens, overlap=overlap))
        for b in loop_batches:
            closed.append({"batch": b, "overlap": overlap,
                           **closed_loop(engine, model, b, loop_frames, loop_steps, prefix)})
        del engine
    stepped = [m for m in modes if m in rows]
    print(f"\nframe step (ms), {config.num_layers}-layer talker + {config.num_code_groups - 1} predictor sub-steps,"
          f" {dtype}, {device}")
    print(f"{'batch':>6} " + " ".join(f"{m:>12}" for m in stepped) + "   frames/s (best)  audio s/s")
    results = []
    for b in batches if stepped else []:
        best = min(rows[m][b] for m in stepped)
        print(f"{b:>6} " + " ".join(f"{rows[m][b]:>12.2f}" for m in stepped)
              + f"   {1000 * b / best:>15.0f}  {1000 * b / best * FRAME_S:>9.1f}")
        results.append({"batch": b, **{f"{m}_ms": rows[m][b] for m in stepped},
                        "frames_per_s": 1000 * b / best, "audio_s_per_s": 1000 * b / best * FRAME_S})
    print(f"\nprefill step, prefill + first frame (ms, median)\n{'prompt':>28} " + " ".join(f"{m:>12}" for m in modes))
    for name, times in ((f"{PROMPT_LEN} tokens", prefill), (f"{SUFFIX_LEN} after {PREFIX_LEN} cached", prefill_suffix)):
        print(f"{name:>28} " + " ".join(f"{times[m]:>12.2f}" for m in modes))
    print(f"\nclosed loop ({loop_mode}, {loop_frames}-frame streams, a known voice's prefill per new stream)")
    print(f"{'batch':>6} {'overlap':>8} {'ms/step':>8} {'prefill steps':>14} {'audio s/s':>10}")
    for row in closed:
        print(f"{row['batch']:>6} {'on' if row['overlap'] else 'off':>8} {row['ms_per_step']:>8.2f} "
              f"{row['prefill_step_share']:>14.2f} {row['audio_s_per_s']:>10.1f}")
    report = {
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny,
        "steps_measured": steps, "frame_step": results, "prefill_100_tokens_ms": prefill,
        f"prefill_{SUFFIX_LEN}_after_{PREFIX_LEN}_cached_ms": prefill_suffix,
        "closed_loop": {"mode": loop_mode, "frames_per_stream": loop_frames, "steps": loop_steps, "rows": closed},
        "wall_s": time.perf_counter() - started,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
