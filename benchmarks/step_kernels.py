#!/usr/bin/env python3
"""Count the kernels one AR decode step launches, per component, on the CPU.

Inside a CUDA graph each kernel still costs ~2-4 us of GPU time, and a 0.6B Qwen3-TTS frame
is thousands of tiny kernels: the step is bound by their number, not by bytes or FLOPs. This
script counts them without a GPU: it runs exactly what :class:`~omnistage.engine.cuda_graph.
CUDAGraphRunner` captures (:meth:`ModelRunner.decode`: talker forward, code-0 sampling, the
15 code-predictor sub-steps with their sampling, the feedback embedding) under
``torch.profiler`` and counts the aten ops that launch a kernel: the lowest ops of the call
tree (an op whose callees launch kernels is not counted itself), minus views and metadata
ops (:data:`NO_KERNEL`). The count is a proxy for the CUDA kernel count: a few ops launch
more than one kernel on CUDA (sort, topk), and CPU SDPA counts as one.

Models: ``toy`` is :class:`~omnistage.testing.toy_ar.ToyTalker` (what benchmarks/engine_gpu.py
times), ``talker`` the real :class:`~omnistage.models.qwen3_tts.modeling.talker.Talker` with
random weights (projections fused as the engine runs it). Counts do not depend on widths, so
``--tiny`` gives the same numbers faster. Sampling is Qwen3-TTS's serving default (code 0:
top-k 50, T 0.9, repetition penalty 1.05, min_new_tokens 2, an EOS id, suppressed control
ids; predictor: top-k 50, T 0.9).

Usage: python benchmarks/step_kernels.py [--tiny] [--models toy talker] [--batches 1 8]
       [--output benchmarks/results/step_kernels.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage.engine import layers, model_runner, moe
from omnistage.engine.attention import DenseKVCache
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.model_runner import ARModelSpec, StepSampling
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_tts.engine_model import Qwen3TTSEngineModel
from omnistage.models.qwen3_tts.modeling.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.modeling.talker import RotaryEmbedding, Talker
from omnistage.models.qwen3_tts.random_checkpoint import build_config_dict
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker

# aten ops (as the dispatcher sees them) that only make views or allocate: no kernel on CUDA
NO_KERNEL = frozenset((
    "view", "_reshape_alias", "as_strided", "expand", "slice", "select", "unsqueeze", "squeeze", "transpose", "t",
    "permute", "detach", "_unsafe_view", "alias", "split", "split_with_sizes", "unbind", "unfold", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
))
COMPONENTS = ("talker layers", "code-0 head", "code-0 sampling", "predictor layers", "predictor heads+embeds",
              "predictor sampling", "feedback", "runner glue")
PROMPT_LEN = 6
DTYPE = torch.bfloat16  # as served on CUDA: the casts to and from fp32 are kernels too


def build_talker(tiny: bool) -> Qwen3TTSEngineModel:
    """The real talker, random weights, bf16 on the CPU (RoPE table fp32, as loaded): 0.6B
    sizes, or tiny widths at the 0.6B depths (28 talker and 5 predictor layers)."""
    raw = build_config_dict("tiny" if tiny else "0.6b", "custom_voice")
    talker, predictor = raw["talker_config"], raw["talker_config"]["code_predictor_config"]
    talker["num_hidden_layers"], predictor["num_hidden_layers"] = 28, 5
    predictor["hidden_size"] = talker["hidden_size"]  # as in 0.6B: no input projection
    config = Qwen3TTSConfig.from_dict(raw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Talker(config.talker, config.code_predictor).to(DTYPE).eval().requires_grad_(False)
    for rotary in (m for m in model.modules() if isinstance(m, RotaryEmbedding)):
        rotary.reset_buffers("cpu")
    model.fuse_projections()
    return Qwen3TTSEngineModel(model)  # the serving adapter


def build_toy(tiny: bool) -> ToyTalker:
    """The toy (bf16) at the 0.6B sizes, or tiny widths at the 0.6B depths and vocabularies."""
    real = ToyARConfig.qwen3_tts_0b6()
    return ToyTalker(dataclasses.replace(ToyARConfig(), num_layers=real.num_layers, vocab_size=real.vocab_size,
                                         num_code_groups=real.num_code_groups, code_vocab_size=real.code_vocab_size,
                                         predictor_layers=real.predictor_layers) if tiny else real, DTYPE)


class KernelCounter(TorchDispatchMode):
    """Records every aten op that reaches the dispatcher with the innermost component label
    (:meth:`labelled`) and the innermost omnistage source line that called it.

    Ops are seen after composite ops decomposed (``linear`` is ``t`` + ``mm``) and without
    the ops a kernel calls internally, so each recorded op outside :data:`NO_KERNEL` is one
    kernel launch on CUDA (to a first approximation: a few ops, e.g. ``sort``, launch more).
    """

    def __init__(self) -> None:
        super().__init__()
        self.labels: list[str] = ["runner glue"]
        self.ops: list[tuple[str, str]] = []  # (component, "op @ file:line")
        self.muted = 0  # > 0 inside a call counted as one kernel (see one_kernel)

    def labelled(self, fn: Callable, label: str | Callable[..., str]) -> Callable:
        """``fn`` whose ops count for ``label`` (or ``label(*args)``)."""
        def wrapper(*args, **kwargs):
            self.labels.append(label(*args) if callable(label) else label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.labels.pop()
        return wrapper

    def one_kernel(self, fn: Callable, name: str) -> Callable:
        """``fn`` counted as the one kernel ``name`` it is on CUDA (its CPU ops are not)."""
        def wrapper(*args, **kwargs):
            self.ops.append((self.labels[-1], f"{name} @ {_call_site()}"))
            self.muted += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.muted -= 1
        return wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.muted and name not in NO_KERNEL:
            self.ops.append((self.labels[-1], f"{name} @ {_call_site()}"))
        return func(*args, **(kwargs or {}))


def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/omnistage/" in frame.filename:
            return f"{frame.filename.split('/omnistage/')[-1]}:{frame.lineno}"
    return "?"


def label_components(engine: AREngine, counter: KernelCounter, stack: contextlib.ExitStack) -> None:
    """Wrap the step's pieces (until ``stack`` closes) so that every op counts for its
    component."""
    runner, model = engine.runner, engine.runner.model
    predictor = model.talker.code_predictor.model if isinstance(model, Qwen3TTSEngineModel) else model.predictor.model
    vocab = model.spec.vocab_size
    targets = [(predictor, "forward", "predictor layers"), (model, "forward", "talker layers"),
               (model, "head_logits", "code-0 head"), (model, "complete_frame", "predictor heads+embeds"),
               (model, "next_input_embeds", "feedback"), (runner, "_predictor_sampler", "predictor sampling"),
               (model_runner, "sample", lambda logits, *_: "code-0 sampling" if logits.shape[-1] == vocab
                else "predictor sampling")]
    for batch, label in ((runner.sampling, "code-0 sampling"), (runner.predictor_sampling, "predictor sampling")):
        targets += [(batch, "select", label), (batch, "record", label)]
    for owner, name, label in targets:
        stack.enter_context(mock.patch.object(owner, name, counter.labelled(getattr(owner, name), label)))
    # one kernel on CUDA, several ops on the CPU: the layers' Triton kernels (RMSNorm with its
    # weight and residual add, q/k norms with RoPE, SwiGLU) and the Triton paged decode (the
    # CPU runs the gather-based reference)
    for owner, name in ((layers, "rms_norm"), (layers, "qk_norm_rope"), (layers, "swiglu"), (moe, "swiglu")):
        stack.enter_context(mock.patch.object(owner, name, counter.one_kernel(getattr(owner, name), f"{name} (Triton)")))
    attn = runner.attn
    stack.enter_context(mock.patch.object(
        attn, "decode_attention", counter.one_kernel(attn.decode_attention, "paged_decode (Triton)")))
    # a fused-decode dense cache's one-token forward (the predictor's sub-steps after the
    # first) is the dense decode kernel on CUDA: its two cache writes and SDPA
    dense_call = DenseKVCache.__call__
    dense_kernel = counter.one_kernel(dense_call, "dense_decode (Triton)")

    def dense(cache: DenseKVCache, *args: object) -> torch.Tensor:
        return (dense_kernel if cache._new == 1 and cache.fused_decode else dense_call)(cache, *args)

    stack.enter_context(mock.patch.object(DenseKVCache, "__call__", dense))


def request(spec: ARModelSpec, seed: int) -> GenerationInput:
    g = torch.Generator().manual_seed(seed)
    vocab = spec.vocab_size
    sampling = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, min_new_tokens=2, seed=seed,
                              stop_token_ids=(vocab - 1,), suppress_ranges=((vocab // 2, vocab - 1),))
    return GenerationInput(
        torch.randn(PROMPT_LEN, spec.hidden_size, generator=g), sampling, 4,
        step_rows=torch.randn(2, spec.hidden_size, generator=g), pad_embed=torch.randn(spec.hidden_size, generator=g),
        predictor_sampling=SamplingParams(temperature=0.9, top_k=50, seed=seed + 1),
    )


def count_step(model, batch: int) -> dict:
    """Kernel ops of one captured-style decode step (:meth:`ModelRunner.decode` over all
    block-table columns) of ``batch`` requests, after their prefill."""
    engine = AREngine(model, EngineConfig(kv_cache_bytes=4 << 20 if model.spec.hidden_size < 512 else 512 << 20,
                                          max_num_seqs=batch, max_model_len=64, prefill_hold_ms=0.0,
                                          num_step_rows=16 * batch))
    for i in range(batch):
        engine.add_request(f"r{i}", request(model.spec, i))
    while engine.scheduler.waiting or any(s.num_scheduled == 0 for s in engine.scheduler.running):
        engine.step()
    seqs = engine.scheduler.running
    runner = engine.runner
    meta, cache = runner.upload_meta(runner.decode_meta(seqs)), model.new_frame_cache(batch)
    counter = KernelCounter()
    with contextlib.ExitStack() as stack, torch.no_grad():
        label_components(engine, counter, stack)
        with counter:
            runner.decode(meta, cache, sampling=StepSampling.of(seqs))
    by_component = collections.Counter(c for c, _ in counter.ops)
    sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for c, where in counter.ops:
        sites[c][where] += 1
    return {
        "total": len(counter.ops),
        "components": {c: by_component.get(c, 0) for c in COMPONENTS},
        "top_sites": {c: sites[c].most_common(8) for c in COMPONENTS if sites[c]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny widths, real depths (same counts, faster)")
    parser.add_argument("--models", nargs="+", default=["toy", "talker"], choices=["toy", "talker"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--output", default="benchmarks/results/step_kernels.json")
    args = parser.parse_args()
    started = time.perf_counter()
    results = {}
    for name in args.models:
        model = build_toy(args.tiny) if name == "toy" else build_talker(args.tiny)
        results[name] = {str(b): count_step(model, b) for b in args.batches}
        del model
    print(f"kernel-launching ops of one decode step ({'tiny' if args.tiny else '0.6B'} widths)")
    header = f"{'component':<24}" + "".join(f"{m + ' b' + str(b):>14}" for m in results for b in args.batches)
    print(header + "\n" + "-" * len(header))
    for c in (*COMPONENTS, "total"):
        cells = [r[str(b)]["total"] if c == "total" else r[str(b)]["components"][c]
                 for r in results.values() for b in args.batches]
        print(f"{c:<24}" + "".join(f"{n:>14}" for n in cells))
    for name, per_batch in results.items():
        print(f"\ntop op sites, {name}, batch {args.batches[0]}:")
        for c, sites in per_batch[str(args.batches[0])]["top_sites"].items():
            print(f"  {c}: " + ", ".join(f"{s} x{n}" for s, n in sites[:5]))
    report = {"tiny": args.tiny, "torch": torch.__version__, "models": results,
              "wall_s": time.perf_counter() - started}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
