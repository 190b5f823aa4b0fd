"""Qwen3-TTS served by omnistage on one GPU: TTFA, RTF and audio throughput by concurrency.

For each size (0.6b, 1.7b) this builds a random Base checkpoint with the REAL dimensions
(``omnistage init-random --device cuda``), serves it with ``omnistage serve`` and drives
it with ``omnistage bench speed`` (streaming PCM; voice clone (ICL) with one fixed 3 s
reference, so after the first request the reference is a cache hit; a fixed target text;
every request exactly ``--frames`` frames: ``min_new_tokens = max_new_tokens``, so EOS
cannot end it early). Then it measures TTFA with a FRESH 3 s reference per request
(encoded on the request path), and reads GPU memory.

Prints a table and writes ``OUT_DIR/qwen3_tts_gpu.json`` (every level's ``bench speed``
record) and the server logs. Run on the device (see benchmarks/README.md)::

    python benchmarks/qwen3_tts_gpu.py --out-dir results --sizes 0.6b 1.7b
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile

from omnistage.bench import BenchSample, SpeechTarget
from omnistage.bench.speed import request_speech

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet green forest."
REF_TEXT = "This is the voice you should sound like in every sentence."
SAMPLE_RATE = 24000


def reference_wav(seed: int, seconds: float = 3.0) -> bytes:
    """A seeded 3 s voice-like clip (harmonics of a gliding pitch + noise), WAV bytes."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = 110 + 40 * rng.random() + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    audio = sum(np.sin(k * phase) / k for k in range(1, 8)) * 0.2 + 0.02 * rng.standard_normal(t.size)
    audio *= 0.5 + 0.5 * np.abs(np.sin(2 * np.pi * 2.1 * t))
    buffer = io.BytesIO()
    soundfile.write(buffer, audio.astype(np.float32), SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def data_uri(wav: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


def gpu_memory_mib() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[0])


class MemoryPeak(threading.Thread):
    """Polls nvidia-smi every 0.5 s while running; ``peak`` in MiB."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self._halt = 0.0, threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, gpu_memory_mib())
            self._halt.wait(0.5)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        return self.peak


def start_server(model_dir: Path, port: int, max_conc: int, log: Path) -> tuple[subprocess.Popen, float]:
    cmd = [
        sys.executable, "-m", "omnistage.cli", "serve", "--model-path", str(model_dir), "--port", str(port),
        "--allowed-local-media-path", str(model_dir.parent),
        "--max_concurrent_requests", str(2 * max_conc),
        "--tts_engine.factory.args.max_num_seqs", str(max_conc),
        "--vocoder.factory.args.num_slots", str(max_conc),
        "--log-level", "warning",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while time.perf_counter() - start < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy in 600 s")


def bench_level(port: int, conc: int, frames: int, ref: Path, out: Path) -> dict:
    """One ``omnistage bench speed`` level; ``ref`` is a WAV under the server's allowed
    local media directory (a 3 s data URI is longer than one command-line argument may be).
    A level that fails is recorded (``{"concurrency": c, "error": ...}``), not raised, so
    the levels after it still run."""
    n = max(8, 2 * conc)
    fields = {"ref_audio": str(ref), "ref_text": REF_TEXT, "max_new_tokens": frames, "min_new_tokens": frames, "language": "english"}
    cmd = [
        sys.executable, "-m", "omnistage.cli", "bench", "speed", "--base-url", f"http://127.0.0.1:{port}",
        "--concurrency", str(conc), "--num-requests", str(n), "--warmup", "2", "--stream", "--output", str(out),
    ]  # fmt: skip
    for key, value in fields.items():
        cmd += ["--extra", f"{key}={json.dumps(value)}"]
    meta = out.with_suffix(".lst")
    meta.write_text(f"s0|{REF_TEXT}||{TEXT}\n", encoding="utf-8")
    cmd += ["--meta-lst", str(meta)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout[-3000:], flush=True)
    if done.returncode != 0:
        return {"concurrency": conc, "error": (done.stdout + done.stderr)[-1500:]}
    return json.loads(out.read_text())["levels"][0]


async def fresh_reference_ttfa(port: int, frames: int, count: int) -> list[float]:
    """TTFA (ms) of ``count`` sequential requests, each with a reference never seen before."""
    ttfa = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(count):
            fields = {"ref_audio": data_uri(reference_wav(1000 + i)), "ref_text": REF_TEXT, "max_new_tokens": frames, "min_new_tokens": frames}
            target = SpeechTarget(f"http://127.0.0.1:{port}", extra_fields=fields)
            result = await request_speech(client, target, BenchSample(f"fresh{i}", TEXT), stream=True)
            if not result.ok:
                raise RuntimeError(result.error)
            ttfa.append(result.ttfa_ms)
    return ttfa


def run_size(size: str, args: argparse.Namespace, record: dict, save) -> None:
    """Fill ``record`` for one size, calling ``save()`` after every step (a later failure
    or the device's time limit keeps what was measured)."""
    model_dir = Path(args.work_dir) / f"qwen3_tts_{size}_base"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "init-random", "--arch", "Qwen3TTSForConditionalGeneration",
         "--size", size, "--type", "base", "--device", "cuda", str(model_dir)],
        check=True,
    )  # fmt: skip
    record |= {"size": size, "init_random_s": round(time.perf_counter() - t0, 1), "gpu_mib": {"before_server": gpu_memory_mib()}}
    port = 8100
    proc, startup_s = start_server(model_dir, port, max(args.concurrency), Path(args.out_dir) / f"server_{size}.log")
    record["server_startup_s"] = round(startup_s, 1)
    record["gpu_mib"]["after_startup"] = gpu_memory_mib()
    save()
    try:
        ref = model_dir.parent / f"reference_{size}.wav"
        ref.write_bytes(reference_wav(7))
        record["levels"], peak = [], MemoryPeak()
        peak.start()
        for conc in args.concurrency:
            level = bench_level(port, conc, args.frames, ref, Path(args.work_dir) / f"bench_{size}_c{conc}.json")
            record["levels"].append(level)
            save()
        record["gpu_mib"] |= {"peak_during_bench": peak.stop()}
        fresh = asyncio.run(fresh_reference_ttfa(port, args.frames, 8))
        record["fresh_reference_ttfa_ms"] = {"p50": float(np.median(fresh)), "all": [round(x, 1) for x in fresh]}
        save()
    finally:
        proc.terminate()
        proc.wait(30)


def print_table(results: list[dict], frames: int) -> None:
    print(f"\n{'size':6} {'conc':>5} {'TTFA p50':>9} {'TTFA p99':>9} {'RTF p50':>8} {'RTF p99':>8} {'audio s/s':>10} {'ms/frame':>9} {'fail':>5}")
    for r in results:
        for lv in r.get("levels", []):
            if "error" in lv:
                print(f"{r['size']:6} {lv['concurrency']:>5} FAILED: {lv['error'][-200:]}")
                continue
            ttfa, rtf = lv["ttfa_ms"], lv["rtf"]
            per_frame = lv["latency_ms"]["p50"] / frames
            print(
                f"{r['size']:6} {lv['concurrency']:>5} {ttfa['p50']:>9.1f} {ttfa['p99']:>9.1f} {rtf['p50']:>8.3f} "
                f"{rtf['p99']:>8.3f} {lv['audio_throughput']:>10.1f} {per_frame:>9.2f} {lv['num_failed']:>5}"
            )
        if "fresh_reference_ttfa_ms" in r:
            print(f"{r['size']:6} fresh 3 s reference, concurrency 1: TTFA p50 {r['fresh_reference_ttfa_ms']['p50']:.1f} ms")
        print(f"{r['size']:6} startup {r.get('server_startup_s')} s; GPU MiB {r.get('gpu_mib')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--work-dir", default="/tmp")
    parser.add_argument("--sizes", nargs="+", default=["0.6b", "1.7b"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--frames", type=int, default=125)
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []

    def save() -> None:
        (out_dir / "qwen3_tts_gpu.json").write_text(json.dumps({"frames": args.frames, "results": results}, indent=2))

    for size in args.sizes:
        results.append({})
        run_size(size, args, results[-1], save)
    print_table(results, args.frames)


if __name__ == "__main__":
    main()
