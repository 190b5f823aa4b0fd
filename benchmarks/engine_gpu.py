#!/usr/bin/env python3
"""Benchmark the AR engine at the real Qwen3-TTS 0.6B sizes with random weights.

The model is the toy talker (:mod:`omnistage.testing.toy_ar`) scaled up: talker 28 Qwen3
layers (hidden 1024, 16 heads, 8 kv heads, head_dim 128, intermediate 3072, vocab 3072),
code predictor 5 layers with 15 sub-steps over 2048 codes, bf16. Sampling as Qwen3-TTS
serves it: top-k 50, T 0.9, repetition penalty 1.05 (code 0; EOS never sampled, codes
2048..3071 suppressed), predictor top-k 50, T 0.9.

Measures, on CUDA: the frame step time (talker + code predictor + sampling, the engine's
own loop, host overlap on) at batch 1, 8, 32, 64, 128, eager vs CUDA graphs; the prefill
time of one 100-token prompt; frames and audio seconds per wall second (80 ms per frame).
Prints a table and writes JSON (default benchmarks/results/engine_gpu.json).

Usage: python benchmarks/engine_gpu.py [--output PATH]
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def request(config: ToyARConfig, device: torch.device, dtype: torch.dtype, seed: int, max_new: int) -> GenerationInput:
    g = torch.Generator(device=device).manual_seed(seed)
    h = config.hidden_size
    sampling = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=seed,
                              suppress_ranges=((min(2048, config.vocab_size - 1), config.vocab_size),))
    return GenerationInput(
        torch.randn(PROMPT_LEN, h, generator=g, device=device, dtype=dtype), sampling, max_new,
        step_rows=torch.randn(8, h, generator=g, device=device, dtype=dtype),
        pad_embed=torch.randn(h, generator=g, device=device, dtype=dtype),
        predictor_sampling=SamplingParams(temperature=0.9, top_k=50, seed=seed + 1),
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


def prefill_ms(engine: AREngine, model: ToyTalker, runs: int) -> float:
    """Median time of one prefill step of a single 100-token prompt (launch to device done)."""
    spec, times = model.spec, []
    for run in range(runs):
        engine.add_request(f"p{run}", request(model.c, spec.device, spec.dtype, 1000 + run, 2))
        sync(spec.device)
        start = time.perf_counter()
        engine.step()
        sync(spec.device)
        times.append(1000 * (time.perf_counter() - start))
        engine.abort(f"p{run}")
        while engine.has_work():
            engine.step()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny toy sizes (a smoke test)")
    parser.add_argument("--output", default="benchmarks/results/engine_gpu.json")
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
    modes = {"eager": ()} | ({"cuda_graphs": tuple(batches)} if on_cuda else {})
    rows: dict[str, dict[int, float]] = {}
    prefill: dict[str, float] = {}
    for mode, sizes in modes.items():
        built = time.perf_counter()
        engine = AREngine(model, EngineConfig(**engine_args, cuda_graph_batch_sizes=sizes))
        print(f"{mode}: engine built in {time.perf_counter() - built:.1f} s", flush=True)
        prefill[mode] = prefill_ms(engine, model, runs=5 if on_cuda else 1)
        rows[mode] = {b: frame_step_ms(engine, model, b, warmup, steps) for b in batches}
        del engine
    print(f"\nframe step (ms), {config.num_layers}-layer talker + {config.num_code_groups - 1} predictor sub-steps,"
          f" {dtype}, {device}")
    print(f"{'batch':>6} " + " ".join(f"{m:>12}" for m in modes) + "   frames/s (best)  audio s/s")
    results = []
    for b in batches:
        best = min(rows[m][b] for m in modes)
        print(f"{b:>6} " + " ".join(f"{rows[m][b]:>12.2f}" for m in modes)
              + f"   {1000 * b / best:>15.0f}  {1000 * b / best * FRAME_S:>9.1f}")
        results.append({"batch": b, **{f"{m}_ms": rows[m][b] for m in modes},
                        "frames_per_s": 1000 * b / best, "audio_s_per_s": 1000 * b / best * FRAME_S})
    print("prefill of a 100-token prompt (ms): " + ", ".join(f"{m} {v:.2f}" for m, v in prefill.items()))
    report = {
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny,
        "steps_measured": steps, "frame_step": results, "prefill_100_tokens_ms": prefill,
        "wall_s": time.perf_counter() - started,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
