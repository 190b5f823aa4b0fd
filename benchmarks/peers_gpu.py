#!/usr/bin/env python3
"""Benchmark two peer implementations of Qwen3-TTS on one checkpoint (see PEERS.md).

Peers (imported and called, never copied):
  * reference  -- `qwen-tts-hf` 0.1.1.post1 (Qwen3TTSModel.generate_voice_clone), non-streaming
  * faster     -- `faster-qwen3-tts` 0.5.4 (CUDA graphs): non-streaming, and streaming at chunk 1/4/12
(`faster-qwen3-tts-batch` 0.2.0 is left out: it does not run under transformers 5.17; PEERS.md.)

Workload: voice clone (ICL) from a seeded synthetic 3 s, 24 kHz reference clip, a fixed English
target text, exactly --frames frames (EOS masked), sampling top-k 50, T 0.9, repetition penalty 1.05.

Usage: python benchmarks/peers_gpu.py CHECKPOINT_DIR --out results.json
         [--device cuda|cpu] [--frames 125] [--runs 3] [--only reference,faster]
On CPU the CUDA graphs of the faster peers are emulated eagerly (a smoke test of the call
paths only: CPU numbers say nothing about the peers).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types

import numpy as np

SR = 24000
FRAME_S = 1920 / SR  # 80 ms per codec frame (12.5 Hz)
REF_SECONDS = 3.0
REF_TEXT = "This is a short synthetic reference clip for voice cloning."
TARGET_TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs back home "
               "to rest beside the warm fire before the evening rain begins.")
SAMPLING = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05)
STREAM_CHUNKS = (1, 4, 12)
SHIMS_APPLIED: list[str] = []


# ----------------------------------------------------------------------------- shims
def _stub_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__path__ = []  # a package, so submodule stubs can hang off it
    return mod


def apply_shims() -> None:
    """Minimal, documented shims (PEERS.md), applied before the peers are imported."""
    # 1. torchaudio: qwen_tts imports it at import time, but only for the 25 Hz tokenizer's
    #    x-vector extractor (torchaudio.compliance.kaldi), which a 12 Hz checkpoint never runs.
    #    Only where `import torchaudio` fails (e.g. a CPU venv whose torchaudio build does not
    #    match torch) is it replaced by an empty stub. The device image's torchaudio is used as is.
    try:
        import torchaudio  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (ImportError or OSError from a mismatched build)
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]
        for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
            sys.modules[name] = _stub_module(name)
        SHIMS_APPLIED.append(f"torchaudio stub (import failed: {type(exc).__name__})")

    # 2. RoPE 'default' init: transformers 5.x dropped 'default' from ROPE_INIT_FUNCTIONS and
    #    qwen_tts registers its own, which reads `config.rope_theta`. transformers 5.x's MimiConfig
    #    (the 12 Hz speech tokenizer's encoder) keeps theta only in `config.rope_parameters`, so
    #    the load fails with "'MimiConfig' object has no attribute 'rope_theta'". Wrap the
    #    registered function: copy theta from rope_parameters onto such configs, then call it.
    import qwen_tts  # noqa: F401  (registers its 'default' RoPE init)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inner = ROPE_INIT_FUNCTIONS.get("default")
    if inner is not None and not getattr(inner, "_peers_gpu_shim", False):
        def default_rope(config, device=None, seq_len=None, layer_type=None):
            if not hasattr(config, "rope_theta"):
                params = getattr(config, "rope_parameters", None) or {}
                if layer_type is not None and isinstance(params.get(layer_type), dict):
                    params = params[layer_type]
                if "rope_theta" in params:
                    config.rope_theta = params["rope_theta"]
            return inner(config, device=device, seq_len=seq_len, layer_type=layer_type)

        default_rope._peers_gpu_shim = True
        ROPE_INIT_FUNCTIONS["default"] = default_rope
        SHIMS_APPLIED.append("RoPE 'default' init reads rope_theta from rope_parameters (MimiConfig)")


class _FakeStream:
    def wait_stream(self, _other):
        pass


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay() re-runs the captured callable."""

    def __init__(self, *a, **k):
        self.fn = None

    def replay(self):
        self.fn()


@contextlib.contextmanager
def emulate_cuda_graphs_on_cpu():
    """CPU smoke test only: let the faster peers' CUDA-graph classes run eagerly.

    Replaces the torch.cuda calls they make (graph, CUDAGraph, Stream, stream, device,
    current_stream, current_device, synchronize) with no-ops, and binds each graph's replay()
    to the method the peer captures (_full_loop / _decode_step)."""
    import torch

    cuda = torch.cuda
    saved = {n: getattr(cuda, n) for n in ("graph", "CUDAGraph", "Stream", "stream", "device",
                                          "current_stream", "current_device", "synchronize")}
    cuda.graph = lambda *a, **k: contextlib.nullcontext()
    cuda.CUDAGraph = _EagerGraph
    cuda.Stream = lambda *a, **k: _FakeStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.device = lambda *a, **k: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _FakeStream()
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    patched = []
    targets = [("faster_qwen3_tts.predictor_graph", "PredictorGraph", "_full_loop"),
               ("faster_qwen3_tts.talker_graph", "TalkerGraph", "_decode_step")]
    for modname, clsname, step in targets:
        try:
            cls = getattr(__import__(modname, fromlist=[clsname]), clsname)
        except ImportError:
            continue
        orig = cls.capture

        def capture(self, *a, _orig=orig, _step=step, **k):
            _orig(self, *a, **k)
            self.graph.fn = getattr(self, _step)

        cls.capture = capture
        patched.append((cls, orig))
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(cuda, n, v)
        for cls, orig in patched:
            cls.capture = orig


# ----------------------------------------------------------------------------- helpers
def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def make_reference_wav(path: str, seed: int = 1234) -> None:
    """Seeded 3 s voice-like clip: harmonics of a wobbling f0 under a syllable envelope."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(REF_SECONDS * SR)) / SR
    f0 = 140 + 25 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    wav = sum(rng.uniform(0.3, 1.0) / k * np.sin(k * phase + rng.uniform(0, 2 * np.pi)) for k in range(1, 9))
    env = np.clip(np.sin(2 * np.pi * 2.2 * t), 0, None) ** 0.6 * np.minimum(1, np.minimum(t, REF_SECONDS - t) / 0.05)
    wav = wav * env + 0.003 * rng.standard_normal(t.size)
    sf.write(path, (0.5 * wav / np.max(np.abs(wav))).astype(np.float32), SR)


class Timer:
    def __init__(self, device: str):
        import torch

        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def med(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def record(impl: str, mode: str, runs: list[dict], **extra) -> dict:
    keys = sorted({k for r in runs for k in r})
    out = {"implementation": impl, "mode": mode, "runs": len(runs)}
    out.update({k: med([r.get(k) for r in runs]) for k in keys})
    out.update(extra)
    out["raw"] = runs
    return out


# ----------------------------------------------------------------------------- peers
def load_reference(ckpt: str, device: str, dtype):
    from qwen_tts import Qwen3TTSModel

    return Qwen3TTSModel.from_pretrained(ckpt, device_map=device, dtype=dtype, attn_implementation="sdpa")


def bench_reference(model, ref_wav: str, frames: int, runs: int, timer: Timer) -> dict:
    inner = model.model  # Qwen3TTSForConditionalGeneration
    tcfg = inner.config.talker_config
    # EOS mask: the reference passes eos_token_id to HF generate and suppresses the top 1024 codec
    # ids except that one. Naming a never-sampled id (vocab_size - 1, inside the suppressed
    # range) as EOS suppresses the real EOS (2150) too, and the stop criterion never fires.
    eos_masked = tcfg.vocab_size - 1
    # max_new_tokens = frames + 1: the reference returns one frame fewer than HF generate steps
    # (the last sampled code-0 token gets no code-predictor pass), so ask for one more.
    captured = {}
    orig_generate = inner.generate

    def timed_generate(*a, **k):
        t0 = timer.now()
        codes, hidden = orig_generate(*a, **k)
        captured["gen_s"] = timer.now() - t0
        captured["frames"] = [int(c.shape[0]) for c in codes]
        return codes, hidden

    inner.generate = timed_generate
    kwargs = dict(text=TARGET_TEXT, language="English", ref_audio=ref_wav, ref_text=REF_TEXT,
                  x_vector_only_mode=False, non_streaming_mode=False, max_new_tokens=frames + 1,
                  eos_token_id=eos_masked, subtalker_dosample=True, subtalker_top_k=50,
                  subtalker_top_p=1.0, subtalker_temperature=0.9, **SAMPLING)
    try:
        t0 = timer.now()
        model.generate_voice_clone(**kwargs)  # warm-up (allocator, kernels)
        warm_s = timer.now() - t0
        out = []
        for _ in range(runs):
            t0 = timer.now()
            prompt = model.create_voice_clone_prompt(ref_audio=ref_wav, ref_text=REF_TEXT, x_vector_only_mode=False)
            prompt_s = timer.now() - t0
            t0 = timer.now()
            wavs, sr = model.generate_voice_clone(voice_clone_prompt=prompt, **{k: v for k, v in kwargs.items()
                                                                                if k not in ("ref_audio", "ref_text", "x_vector_only_mode")})
            total_s = timer.now() - t0
            n = captured["frames"][0]
            audio_s = n * FRAME_S
            out.append({"frames": n, "voice_prompt_ms": prompt_s * 1e3, "total_s": total_s + prompt_s,
                        "generate_s": captured["gen_s"], "ms_per_frame": captured["gen_s"] * 1e3 / n,
                        "ttfa_ms": (total_s + prompt_s) * 1e3, "audio_s": audio_s,
                        "rtf": (total_s + prompt_s) / audio_s, "wav_samples": int(len(wavs[0]))})
    finally:
        inner.generate = orig_generate
    return record("reference (qwen-tts-hf)", "non-streaming", out, warmup_s=round(warm_s, 3),
                  eos_masking=f"eos_token_id={eos_masked} (suppressed id) => real EOS suppressed, no stop",
                  note="ms_per_frame = talker generate (prefill + decode) / frames; total includes "
                       "voice prompt extraction and codec decode")


def load_faster(ckpt: str, device: str, dtype):
    from faster_qwen3_tts import FasterQwen3TTS

    if device == "cuda":
        return FasterQwen3TTS.from_pretrained(ckpt, device="cuda", dtype=dtype, attn_implementation="sdpa")
    # CPU smoke test: from_pretrained refuses CPU; assemble the same parts by their public classes.
    from faster_qwen3_tts.predictor_graph import PredictorGraph
    from faster_qwen3_tts.talker_graph import TalkerGraph

    base = load_reference(ckpt, "cpu", dtype)
    talker = base.model.talker
    tcfg = base.model.config.talker_config
    pg = PredictorGraph(talker.code_predictor, talker.code_predictor.model.config, tcfg.hidden_size,
                        device="cpu", dtype=dtype, do_sample=True, top_k=50, temperature=0.9)
    tg = TalkerGraph(talker.model, tcfg, device="cpu", dtype=dtype, max_seq_len=2048)
    return FasterQwen3TTS(base_model=base, predictor_graph=pg, talker_graph=tg, device="cpu", dtype=dtype,
                          max_seq_len=2048)


def bench_faster(model, ref_wav: str, frames: int, runs: int, timer: Timer) -> list[dict]:
    import faster_qwen3_tts.generate as fgen

    # EOS mask: min_new_tokens = max_new_tokens = frames (EOS logit is set to -inf while fewer
    # than min_new_tokens frames exist), so every run decodes exactly `frames` frames.
    kwargs = dict(text=TARGET_TEXT, language="English", ref_audio=ref_wav, ref_text=REF_TEXT,
                  max_new_tokens=frames, min_new_tokens=frames, xvec_only=False, **SAMPLING)
    captured = {}
    orig = fgen.fast_generate

    def timed(*a, **k):
        codes, timing = orig(*a, **k)
        captured.update(timing)
        return codes, timing

    fgen.fast_generate = timed  # model.py imports it from the module at call time
    records = []
    try:
        prefill_len = 100
        t0 = timer.now()
        model.warmup(prefill_len=prefill_len)  # CUDA graph capture of predictor + talker step
        capture_s = timer.now() - t0
        t0 = timer.now()
        model.generate_voice_clone(**kwargs)  # first call: voice prompt extraction (then cached)
        first_s = timer.now() - t0
        out = []
        for _ in range(runs):
            t0 = timer.now()
            wavs, sr = model.generate_voice_clone(**kwargs)
            total_s = timer.now() - t0
            n = captured["steps"]
            audio_s = n * FRAME_S
            out.append({"frames": n, "total_s": total_s, "prefill_ms": captured["prefill_ms"],
                        "ms_per_frame": captured["decode_s"] * 1e3 / n, "ttfa_ms": total_s * 1e3,
                        "audio_s": audio_s, "rtf": total_s / audio_s, "wav_samples": int(len(wavs[0]))})
        records.append(record("faster-qwen3-tts", "non-streaming", out, graph_capture_s=round(capture_s, 3),
                              first_call_s=round(first_s, 3),
                              eos_masking="min_new_tokens = max_new_tokens = frames",
                              note="ms_per_frame = decode loop only (peer's own synchronized timing); "
                                   "voice prompt cached by the peer after the first call"))
    finally:
        fgen.fast_generate = orig

    skw = {k: v for k, v in kwargs.items()}
    for chunk in STREAM_CHUNKS:
        list(model.generate_voice_clone_streaming(chunk_size=chunk, **skw))  # warm-up per chunk size
        out = []
        for _ in range(runs):
            t0 = timer.now()
            ttfa = None
            n = samples = 0
            decode_ms = 0.0
            for audio, _sr, timing in model.generate_voice_clone_streaming(chunk_size=chunk, **skw):
                if ttfa is None:
                    ttfa = timer.now() - t0
                n += int(timing.get("chunk_steps", 0))
                decode_ms += float(timing.get("decode_ms", 0.0))
                samples += len(audio)
            total_s = timer.now() - t0
            audio_s = n * FRAME_S
            out.append({"frames": n, "ttfa_ms": ttfa * 1e3, "total_s": total_s, "audio_s": audio_s,
                        "rtf": total_s / audio_s, "ms_per_frame": decode_ms / max(n, 1),
                        "audio_samples": samples})
        records.append(record("faster-qwen3-tts", f"streaming chunk {chunk}", out,
                              eos_masking="min_new_tokens = max_new_tokens = frames",
                              note="ttfa = call to first yielded audio chunk; ms_per_frame = peer's "
                                   "per-chunk decode time (talker+predictor, excl. codec decode) / frames"))
    return records


# ----------------------------------------------------------------------------- main
def print_table(records: list[dict]) -> None:
    cols = [("implementation", 24), ("mode", 20), ("frames", 7), ("ms_per_frame", 13), ("prefill_ms", 11),
            ("ttfa_ms", 10), ("total_s", 9), ("rtf", 8)]
    print(" ".join(f"{c:<{w}}" for c, w in cols))
    for r in records:
        cells = []
        for c, w in cols:
            v = r.get(c)
            v = "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
            cells.append(f"{v:<{w}}")
        print(" ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--frames", type=int, default=125)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="reference,faster")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    which = set(a.only.split(","))

    apply_shims()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("CUDA not available", file=sys.stderr)
        return 2
    torch.manual_seed(a.seed)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    timer = Timer(a.device)
    meta = {
        "checkpoint": os.path.abspath(a.checkpoint), "device": a.device,
        "device_name": torch.cuda.get_device_name(0) if a.device == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype), "frames": a.frames, "runs": a.runs, "sampling": SAMPLING,
        "target_text": TARGET_TEXT, "ref_text": REF_TEXT, "ref_seconds": REF_SECONDS,
        "versions": {d: version_of(d) for d in ("torch", "transformers", "qwen-tts-hf", "faster-qwen3-tts",
                                                "librosa", "soundfile")},
        "python": platform.python_version(), "shims": SHIMS_APPLIED,
        "cuda_graphs": "real" if a.device == "cuda" else "emulated eagerly on CPU (smoke test; numbers not meaningful)",
    }
    records, errors = [], []
    tmp = tempfile.mkdtemp(prefix="peers_gpu_")
    ref_wav = os.path.join(tmp, "ref.wav")
    make_reference_wav(ref_wav)
    emulate = emulate_cuda_graphs_on_cpu() if a.device == "cpu" else contextlib.nullcontext()

    def attempt(name, fn):
        try:
            torch.manual_seed(a.seed)
            res = fn()
            records.extend(res if isinstance(res, list) else [res])
        except Exception as exc:  # noqa: BLE001 -- one peer failing must not lose the others
            traceback.print_exc()
            errors.append({"implementation": name, "error": f"{type(exc).__name__}: {exc}"})

    dev = a.device
    if "reference" in which:
        def run_ref():
            t0 = time.perf_counter()
            m = load_reference(a.checkpoint, dev, dtype)
            meta["reference_load_s"] = round(time.perf_counter() - t0, 3)
            try:
                return bench_reference(m, ref_wav, a.frames, a.runs, timer)
            finally:
                del m
                if dev == "cuda":
                    torch.cuda.empty_cache()
        attempt("reference", run_ref)
    if "faster" in which:
        with emulate:
            holder = {}

            def run_load():
                t0 = time.perf_counter()
                holder["m"] = load_faster(a.checkpoint, dev, dtype)
                meta["faster_load_s"] = round(time.perf_counter() - t0, 3)
                return []
            attempt("faster (load)", run_load)
            if "m" in holder:
                attempt("faster", lambda: bench_faster(holder["m"], ref_wav, a.frames, a.runs, timer))
    if dev == "cuda":
        meta["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print_table(records)
    for e in errors:
        print(f"FAILED {e['implementation']}: {e['error']}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "records": records, "errors": errors}, f, indent=1)
    print(f"wrote {a.out}")
    for r in records:
        if r.get("frames") != a.frames:
            print(f"WARNING: {r['implementation']} {r['mode']}: {r.get('frames')} frames, not {a.frames}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
