"""Qwen3-Omni at real dimensions on one GPU: dummy load, MoE layers, graph checks, engine steps.

Builds Qwen3-Omni-30B-A3B's thinker, talker and both encoders with random weights drawn on the
device from the config alone (``load_format="dummy"``: the real checkpoint, 65.7 GB, does
not fit the GPU machine's disk), fuses their projections as the pipeline does
(``stages.loaded_model``), then runs up to three parts (``--parts``):

- ``moe``: per-layer time of the routed MoE's grouped path (:class:`~omnistage.engine.moe.SparseMoE`
  as served) at 1, 8 and 64 tokens, on the model's own first ``--moe-layers`` thinker and
  talker MoE layers run back to back (each its own weights, so nothing stays in L2), eagerly
  and replayed from one CUDA graph, with its difference from the per-expert loop;
- ``check``: the thinker (``return_hidden``) and the talker (rows streamed in with
  ``append_step_rows`` after every step, as the talker stage does) on engines built with the
  pipeline's own :func:`~omnistage.models.qwen3_omni.stages.engine_config`, CUDA graphs on
  vs off (and a second eager run: a step that is not reproducible eagerly shows there), the
  same requests: tokens / frames and hidden rows compared step by step;
- ``engine``: thinker and talker decode steps per batch size (the engine's CUDA graphs,
  buckets = the batch sizes, the greedy variant captured at start-up):

  * thinker: a token LM with 3-D MRoPE positions and the talker's hidden layers returned,
    ``B`` requests of a 64-token text prompt decoding 64 tokens each;
  * talker: code 0 + the code predictor's 15 sub-steps per frame, ``B`` requests of a 32-row
    prompt decoding 48 frames.

Prints a table per part and writes everything as JSON. Stop ids are off in ``engine`` (every
request runs its full length; random weights would stop at random). This is the engine-level
speed; the served pipeline's TTFT/TTFA are ``qwen3_omni_served.py``'s.

Usage (device): ``python benchmarks/qwen3_omni_gpu.py --output $OUT/qwen3_omni_gpu.json``;
a CPU dry run: ``--size tiny --device cpu``.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.layers import fuse_projections
from omnistage.engine.model_runner import StepSampling
from omnistage.engine.moe import SparseMoE
from omnistage.engine.sampler import SamplerFeatures, SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel, ThinkerEngineModel
from omnistage.models.qwen3_omni.modeling.model import LoadedOmni, load_model
from omnistage.models.qwen3_omni.payload_types import OmniSampling
from omnistage.models.qwen3_omni.random_checkpoint import write_config
from omnistage.models.qwen3_omni.request_builders import talker_sampling_of
from omnistage.models.qwen3_omni.stages import (
    engine_config,
    talker_graph_sampling,
    talker_sampling_params,
    thinker_graph_sampling,
    thinker_sampling,
)

GREEDY = SamplingParams(temperature=0.0)
GREEDY_STEP = StepSampling(SamplerFeatures.of([GREEDY]), SamplerFeatures.of([GREEDY]))


def gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    gc.collect()  # engines hold graphs and pools in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- moe


def time_chain(fns: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, graphs: bool) -> float:
    """ms per layer of ``x -> fns[0] -> fns[1] -> ...`` (each output is the next input, as
    in a decoder), eagerly or replayed from one CUDA graph."""

    def chain() -> torch.Tensor:
        y = x
        for fn in fns:
            y = fn(y)
        return y

    chain()
    sync()
    repeats = 20
    if graphs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        graph.replay()
        run: Callable[[], object] = graph.replay
    else:
        run = chain
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    sync()
    return (time.perf_counter() - start) * 1e3 / repeats / len(fns)


def bench_moe(loaded: LoadedOmni, device: torch.device, layers: int) -> list[dict]:
    cuda = device.type == "cuda"
    rows = []
    stacks = {
        "thinker": [m for m in loaded.thinker.modules() if isinstance(m, SparseMoE)][:layers],
        "talker": [m for m in loaded.talker.modules() if isinstance(m, SparseMoE)][:layers],
    }
    for part, moes in stacks.items():
        if not cuda:
            for moe in moes:
                moe.impl = "grouped"  # fp32 grouped_mm on the CPU: the dry run checks the path
        # the routed part alone (SparseMoE.forward: the talker's shared expert is left out)
        variants: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
            "grouped": [lambda x, m=m: SparseMoE.forward(m, x) for m in moes],
        }
        hidden = moes[0].gate.weight.shape[1]
        for tokens in (1, 8, 64):
            x = 0.5 * torch.randn(tokens, hidden, device=device, dtype=moes[0].gate.weight.dtype)
            moe = moes[0]
            impl, moe.impl = moe.impl, "loop"
            reference = SparseMoE.forward(moe, x).float()
            moe.impl = impl
            scale = reference.abs().max().item()
            for name, fns in variants.items():
                row: dict = {"part": part, "tokens": tokens, "variant": name}
                try:  # a variant the kernel refuses is recorded, the others still run
                    diff = (fns[0](x).float() - reference).abs().max().item() / scale
                    row |= {"rel_diff_vs_loop": round(diff, 5), "eager_ms": round(time_chain(fns, x, graphs=False), 4)}
                    if cuda:
                        row["graph_ms"] = round(time_chain(fns, x, graphs=True), 4)
                except RuntimeError as exc:
                    row["error"] = str(exc)[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del variants
        if not cuda:
            for moe in moes:
                moe.impl = "auto"
    free(device)
    return rows


# --------------------------------------------------------------------------- check


def thinker_inputs(count: int, length: int, stop: int, seed: int) -> list[GenerationInput]:
    g = torch.Generator().manual_seed(seed)
    return [
        GenerationInput(
            torch.randint(0, 150000, (length,), generator=g), thinker_sampling(OmniSampling(), stop), 12,
            positions=torch.arange(length).expand(3, length).contiguous(), return_hidden=True,
        )  # fmt: skip
        for _ in range(count)
    ]


def run_streamed(engine: AREngine, inputs: list[GenerationInput], rows: list[torch.Tensor] | None) -> dict:
    """Run ``inputs`` to the end; with ``rows``, request ``i`` (given with ``more_rows``)
    gets one more row of ``rows[i]`` after every step, then completes (the talker stage's
    feed). Returns per request its codes ``[T, G]`` and its hidden rows ``[n, K, H]``."""
    ids = [f"r{i}" for i in range(len(inputs))]
    for request_id, item in zip(ids, inputs, strict=True):
        engine.add_request(request_id, item)
    fed = dict.fromkeys(ids, 0)
    codes: dict[str, list[torch.Tensor]] = {i: [] for i in ids}
    hidden: dict[str, list[torch.Tensor]] = {i: [] for i in ids}
    on_device = True
    while engine.has_work():
        for out in engine.step():
            if out.frame is not None:
                codes[out.request_id].append(out.frame)
            if out.hidden is not None:
                on_device &= out.hidden.device == engine.device
                hidden[out.request_id].append(out.hidden.float().cpu())
        if rows is not None:
            for n, request_id in enumerate(ids):
                if fed[request_id] < rows[n].shape[0]:
                    engine.append_step_rows(request_id, rows[n][fed[request_id] : fed[request_id] + 1])
                    fed[request_id] += 1
                    if fed[request_id] == rows[n].shape[0]:
                        engine.complete_step_rows(request_id)
    return {
        "codes": {i: torch.cat(c) if c else torch.empty(0, 1, dtype=torch.int64) for i, c in codes.items()},
        "hidden": {i: torch.cat(h) if h else None for i, h in hidden.items()},
        "hidden_on_engine_device": on_device,
    }


def compare(graphs: dict, eager: dict) -> dict:
    """Steps equal from the start (the least over requests), and the hidden rows' largest
    relative difference over the steps both produced before any token differs."""
    equal_prefix, lengths, worst = [], [], 0.0
    for request_id, codes in eager["codes"].items():
        other = graphs["codes"][request_id]
        n = min(len(codes), len(other))
        same = (codes[:n] == other[:n]).all(dim=1).tolist()
        prefix = same.index(False) if False in same else n
        equal_prefix.append(prefix)
        lengths.append(len(codes))
        h, hg = eager["hidden"][request_id], graphs["hidden"][request_id]
        if h is not None and hg is not None:
            m = min(h.shape[0], hg.shape[0])
            worst = max(worst, ((h[:m] - hg[:m]).abs().max() / h[:m].abs().max()).item())
    return {"equal_steps_min": min(equal_prefix), "steps": lengths, "hidden_rel_diff": round(worst, 5),
            "hidden_on_engine_device": graphs["hidden_on_engine_device"] and eager["hidden_on_engine_device"]}  # fmt: skip


#: The check's engine runs: (name, CUDA graphs). A second eager run tells a graph that
#: differs from eager apart from a step that is not reproducible at all.
RUNS = (("graph", True), ("eager", False), ("eager_again", False))


def check_row(part: str, outs: dict[str, dict]) -> dict:
    """Graph against eager, and eager against eager (``eager_again_*``)."""
    again = compare(outs["eager_again"], outs["eager"])
    return {"part": part, **compare(outs["graph"], outs["eager"]), "eager_again_equal_steps_min": again["equal_steps_min"],
            "eager_again_hidden_rel_diff": again["hidden_rel_diff"], "graph_build_s": round(outs["graph"]["build_s"], 1)}  # fmt: skip


def check_graphs(loaded: LoadedOmni, device: torch.device, max_num_seqs: int) -> list[dict]:
    """Graph vs eager engines of the pipeline's config (``stages.engine_config``)."""
    talker_cfg = loaded.config.talker
    layers = (0, talker_cfg.accept_hidden_layer)
    stop = loaded.config.im_end_id
    results = []
    outs = {}
    for run, graphs in RUNS:
        start = time.perf_counter()
        config = engine_config(max_num_seqs, 1 << 30, 1024, graphs, thinker_graph_sampling(stop))
        engine = AREngine(ThinkerEngineModel(loaded.thinker, layers), config)
        build_s = time.perf_counter() - start
        outs[run] = run_streamed(engine, thinker_inputs(max_num_seqs, 40, stop, seed=7), None)
        outs[run]["build_s"] = build_s
        del engine
        free(device)
    results.append(check_row("thinker", outs))
    talker = loaded.talker
    model = TalkerEngineModel(talker)
    hidden_size = model.spec.hidden_size
    g = torch.Generator().manual_seed(11)
    prompts = [(0.02 * torch.randn(24, hidden_size, generator=g)).to(model.spec.dtype) for _ in range(max_num_seqs)]
    streamed = [(0.02 * torch.randn(12, hidden_size, generator=g)).to(model.spec.dtype) for _ in range(max_num_seqs)]
    sampling, _ = talker_sampling_params(talker, talker_sampling_of(OmniSampling()), 0)
    for run, graphs in RUNS:
        start = time.perf_counter()
        config = engine_config(max_num_seqs, 1 << 29, 512, graphs, talker_graph_sampling(talker))
        engine = AREngine(TalkerEngineModel(talker), config)
        build_s = time.perf_counter() - start
        inputs = [
            GenerationInput(
                p, sampling, 16, step_rows=p[:0], pad_embed=p[0], more_rows=True,
                positions=torch.arange(24).expand(3, 24).contiguous(), rope_delta=0, predictor_sampling=GREEDY,
            )  # fmt: skip
            for p in prompts
        ]
        outs[run] = run_streamed(engine, inputs, [r.to(device) for r in streamed])
        outs[run]["build_s"] = build_s
        del engine
        free(device)
    results.append(check_row("talker", outs))
    for r in results:
        print(json.dumps(r), flush=True)
    return results


# --------------------------------------------------------------------------- engine


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


def bench_config(kv_bytes: int, batches: list[int], max_model_len: int) -> EngineConfig:
    """Buckets = the measured batch sizes, and the greedy variant captured at start-up: no
    step of a measured batch captures a graph (main's run of 2026-12-01 captured each
    batch's greedy variant on its first decode step, inside the timed steps)."""
    return EngineConfig(kv_cache_bytes=kv_bytes, max_num_seqs=max(batches), max_model_len=max_model_len,
                        cuda_graph_batch_sizes=tuple(sorted(set(batches))), graph_sampling=(GREEDY_STEP,))  # fmt: skip


def bench_thinker(loaded: LoadedOmni, batches: list[int], device: torch.device) -> list[dict]:
    talker_cfg = loaded.config.talker
    layers = (0, talker_cfg.accept_hidden_layer) if talker_cfg is not None else ()
    model = ThinkerEngineModel(loaded.thinker, hidden_layers=layers)
    engine = AREngine(model, bench_config(8 << 30, batches, 1024))
    rows = []
    for batch in [1, *batches]:  # the first batch-1 run warms up (Triton, allocator)
        g = torch.Generator().manual_seed(batch)
        inputs = []
        for _ in range(batch):
            ids = torch.randint(0, 150000, (64,), generator=g)
            pos = torch.arange(64).expand(3, 64).contiguous()
            inputs.append(GenerationInput(prompt=ids, sampling=GREEDY, max_new_tokens=64,
                                          positions=pos, return_hidden=bool(layers)))  # fmt: skip
        rows.append({"part": "thinker", "batch": batch, **run_engine(engine, inputs), "gpu_gib": round(gib(), 2)})
    return rows[1:]


def bench_talker(loaded: LoadedOmni, batches: list[int], device: torch.device) -> list[dict]:
    model = TalkerEngineModel(loaded.talker)
    hidden = model.spec.hidden_size
    engine = AREngine(model, bench_config(4 << 30, batches, 512))
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


def profile_thinker(loaded: LoadedOmni, batch: int, device: torch.device) -> list[dict]:
    """The CUDA kernels of eager thinker decode steps at ``batch`` (the kernels a graph
    replays), by total device time: what bounds a step."""
    from torch.profiler import ProfilerActivity, profile

    layers = (0, loaded.config.talker.accept_hidden_layer)
    engine = AREngine(ThinkerEngineModel(loaded.thinker, layers),
                      EngineConfig(kv_cache_bytes=2 << 30, max_num_seqs=batch, max_model_len=256,
                                   cuda_graph_batch_sizes=()))  # fmt: skip
    g = torch.Generator().manual_seed(5)
    for i in range(batch):
        engine.add_request(f"p{i}", GenerationInput(
            torch.randint(0, 150000, (64,), generator=g), GREEDY, 12,
            positions=torch.arange(64).expand(3, 64).contiguous(), return_hidden=True))  # fmt: skip
    for _ in range(4):  # prefill and warm-up decode steps
        engine.step()
    sync()
    steps = 4
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    while engine.has_work():
        engine.step()
    def time_us(e) -> float:  # CPU dry run: self CPU time of the ops
        return e.device_time_total if cuda else e.self_cpu_time_total

    events = sorted((e for e in prof.key_averages() if time_us(e) > 0), key=time_us, reverse=True)
    total = sum(time_us(e) for e in events)
    rows = [{"kernel": e.key[:90], "ms_per_step": round(time_us(e) / 1e3 / steps, 3),
             "calls_per_step": e.count // steps, "share": round(time_us(e) / total, 3)}
            for e in events[:15]]  # fmt: skip
    print(f"thinker eager step at batch {batch}: {total / 1e3 / steps:.2f} ms of kernels", flush=True)
    for r in rows:
        print(f"  {r['ms_per_step']:>7} ms {r['calls_per_step']:>5}x {r['share']:>6} {r['kernel']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--parts", nargs="+", choices=["moe", "check", "engine"], default=["moe", "check", "engine"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--profile-batch", type=int, default=0,
                        help="also list the kernels of eager thinker steps at this batch size (0: no)")
    parser.add_argument("--moe-layers", type=int, default=8, help="MoE layers per part in the moe timing")
    parser.add_argument("--check-seqs", type=int, default=4, help="requests (and max_num_seqs) of the graph check")
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

    def save() -> None:
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else 0.0
        args.output.write_text(json.dumps(result, indent=1))

    with torch.no_grad():
        for part in (loaded.thinker, loaded.talker):
            fuse_projections(part)  # as stages.loaded_model serves them
        if "moe" in args.parts:
            result["moe"] = bench_moe(loaded, device, args.moe_layers)
            save()
        if "check" in args.parts:
            try:
                result["graph_check"] = check_graphs(loaded, device, args.check_seqs)
            except RuntimeError as exc:  # recorded; the engine part still runs
                result["graph_check_error"] = str(exc)[:2000]
                print("graph check failed:", exc, flush=True)
            free(device)
            save()
        if args.profile_batch:
            result["profile"] = profile_thinker(loaded, args.profile_batch, device)
            free(device)
            save()
        rows = []
        if "engine" in args.parts:
            for bench in (bench_thinker, bench_talker):
                try:
                    rows += bench(loaded, args.batches, device)
                except torch.cuda.OutOfMemoryError as exc:  # recorded, and the other part still runs
                    rows.append({"part": bench.__name__, "error": f"CUDA OOM: {exc}"})
                free(device)
                result["rows"] = rows
                save()
    save()
    if "moe" in result:
        print(f"{'moe':8} {'tokens':>6} {'variant':8} {'eager ms':>9} {'graph ms':>9} {'rel diff':>9}")
        for r in result["moe"]:
            if "error" in r:
                print(f"{r['part']:8} {r['tokens']:>6} {r['variant']:8} {r['error'][:100]}")
                continue
            print(f"{r['part']:8} {r['tokens']:>6} {r['variant']:8} {r['eager_ms']:>9} {r.get('graph_ms', '-'):>9} {r['rel_diff_vs_loop']:>9}")
    for r in result.get("graph_check", []):
        print(f"check {r['part']:8} graph==eager for {r['equal_steps_min']} steps of {r['steps']}, "
              f"hidden rel diff {r['hidden_rel_diff']}, hidden on device {r['hidden_on_engine_device']}; "
              f"eager==eager for {r['eager_again_equal_steps_min']} steps, hidden rel diff {r['eager_again_hidden_rel_diff']}")  # fmt: skip
    if rows:
        print(f"{'part':8} {'batch':>5} {'first ms':>9} {'step ms':>8} {'GiB':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:8} {r['error'][:80]}")
            continue
        print(f"{r['part']:8} {r['batch']:>5} {r['first_token_ms']:>9} {r['decode_step_ms']:>8} {r['gpu_gib']:>6}")
    print(f"peak {result['peak_gib']} GiB")


if __name__ == "__main__":
    main()
