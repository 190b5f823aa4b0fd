"""Qwen3-Omni at real dimensions on one GPU: dummy load, thinker and talker steps in the engine.

Builds Qwen3-Omni-30B-A3B's thinker, talker and both encoders with random weights drawn on the
device from the config alone (``load_format="dummy"``: the real checkpoint, 65.7 GB, does
not fit the GPU machine's disk), then drives the AR engine as serving does:

- thinker: a token LM with 3-D MRoPE positions and the talker's hidden layers returned,
  ``B`` requests of a 64-token text prompt decoding 64 tokens each;
- talker: code 0 + the code predictor's 15 sub-steps per frame, ``B`` requests of a 32-row
  prompt decoding 48 frames.

Per batch size it prints prefill time, the mean decode step (ms per token / per frame) and
the GPU memory, and writes them as JSON. Stop ids are off, so every request runs its full
length (random weights would stop at random). This is the engine-level speed; the served
pipeline's TTFT/TTFA are measured by the serving benchmark once the chat pipeline exists.

Usage (device): ``python benchmarks/qwen3_omni_gpu.py --output $OUT/qwen3_omni_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel, ThinkerEngineModel
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.random_checkpoint import write_config

GREEDY = SamplingParams(temperature=0.0)


def gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(engine: AREngine, inputs: list[GenerationInput]) -> dict:
    """Admit every request at once; time the first step (prefill + first token) and the
    decode steps after it, in wall time with the device synchronized at both ends."""
    sync()
    for i, item in enumerate(inputs):
        engine.add_request(f"r{i}", item)
    start = time.perf_counter()
    done, steps, first = 0, 0, None
    while engine.has_work():
        outputs = engine.step()
        steps += 1
        if first is None and any(o.frame is not None for o in outputs):
            sync()
            first = time.perf_counter()
            first_steps = steps
        done += sum(o.result is not None for o in outputs)
    sync()
    end = time.perf_counter()
    decode_steps = max(steps - first_steps, 1)
    return {
        "requests": len(inputs),
        "finished": done,
        "first_token_ms": round((first - start) * 1e3, 2),
        "decode_step_ms": round((end - first) * 1e3 / decode_steps, 3),
        "steps": steps,
    }


def bench_thinker(loaded, batches: list[int], device: torch.device) -> list[dict]:
    talker_cfg = loaded.config.talker
    layers = (0, talker_cfg.accept_hidden_layer) if talker_cfg is not None else ()
    model = ThinkerEngineModel(loaded.thinker, hidden_layers=layers)
    engine = AREngine(model, EngineConfig(kv_cache_bytes=8 << 30, max_num_seqs=max(batches),
                                          max_model_len=1024))  # fmt: skip
    rows = []
    for batch in [1, *batches]:  # the first batch-1 run warms up (graphs, Triton, allocator)
        g = torch.Generator().manual_seed(batch)
        inputs = []
        for _ in range(batch):
            ids = torch.randint(0, 150000, (64,), generator=g)
            pos = torch.arange(64).expand(3, 64).contiguous()
            inputs.append(GenerationInput(prompt=ids, sampling=GREEDY, max_new_tokens=64,
                                          positions=pos, return_hidden=bool(layers)))  # fmt: skip
        rows.append({"part": "thinker", "batch": batch, **run_engine(engine, inputs), "gpu_gib": round(gib(), 2)})
    return rows[1:]


def bench_talker(loaded, batches: list[int], device: torch.device) -> list[dict]:
    model = TalkerEngineModel(loaded.talker)
    hidden = model.spec.hidden_size
    engine = AREngine(model, EngineConfig(kv_cache_bytes=4 << 30, max_num_seqs=max(batches),
                                          max_model_len=512))  # fmt: skip
    rows = []
    for batch in [1, *batches]:
        g = torch.Generator().manual_seed(100 + batch)
        inputs = [
            GenerationInput(
                prompt=(0.02 * torch.randn(32, hidden, generator=g)).to(model.spec.dtype),
                sampling=GREEDY, max_new_tokens=48,
                step_rows=(0.02 * torch.randn(47, hidden, generator=g)).to(model.spec.dtype),
                predictor_sampling=GREEDY, positions=torch.arange(32).expand(3, 32).contiguous(),
            )  # fmt: skip
            for _ in range(batch)
        ]
        rows.append({"part": "talker", "batch": batch, **run_engine(engine, inputs), "gpu_gib": round(gib(), 2)})
    return rows[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--size", choices=["30b-a3b", "tiny"], default="30b-a3b", help="tiny: a CPU dry run")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result: dict = {"device": name, "torch": torch.__version__, "size": args.size}
    with tempfile.TemporaryDirectory() as tmp:
        write_config(tmp, args.size)
        start = time.perf_counter()
        loaded = load_model(tmp, device, parts=("thinker", "talker", "audio_tower", "visual"),
                            load_format="dummy")  # fmt: skip
        sync()
        result["dummy_load_s"] = round(time.perf_counter() - start, 1)
    result["weights_gib"] = round(gib(), 2)
    print(f"dummy load {result['dummy_load_s']} s, weights {result['weights_gib']} GiB", flush=True)
    rows = []
    for bench in (bench_thinker, bench_talker):
        try:
            rows += bench(loaded, args.batches, device)
        except torch.cuda.OutOfMemoryError as exc:  # recorded, and the other part still runs
            rows.append({"part": bench.__name__, "error": f"CUDA OOM: {exc}"})
        torch.cuda.empty_cache()
        result["rows"] = rows
        args.output.write_text(json.dumps(result, indent=1))
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else 0.0
    args.output.write_text(json.dumps(result, indent=1))
    print(f"{'part':8} {'batch':>5} {'first ms':>9} {'step ms':>8} {'GiB':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:8} {r['error'][:80]}")
            continue
        print(f"{r['part']:8} {r['batch']:>5} {r['first_token_ms']:>9} {r['decode_step_ms']:>8} {r['gpu_gib']:>6}")
    print(f"peak {result['peak_gib']} GiB")


if __name__ == "__main__":
    main()
