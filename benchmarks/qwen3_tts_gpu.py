"""Qwen3-TTS served by omnistage on one GPU: TTFA (and where it goes), RTF and audio
throughput, closed and open loop, against faster-qwen3-tts on the same checkpoint.

For each size (0.6b, 1.7b) this builds a random Base checkpoint with the REAL dimensions
(``omnistage init-random --device cuda``), serves it with ``omnistage serve`` and drives
it with ``omnistage bench speed`` (streaming PCM; voice clone (ICL) with one fixed 3 s
reference, so after the first request the reference is a cache hit; a fixed target text;
every request exactly ``--frames`` frames: ``min_new_tokens = max_new_tokens``, so EOS
cannot end it early):

1. closed loop at each ``--concurrency`` level (``--rounds`` times c requests, default 2:
   a closed loop of equal requests arrives in bursts of c, and one level of two bursts
   swung TTFA p99 at c=128 between 451 and 807 ms on an H100, benchmarks/README.md);
2. open loop (Poisson arrivals) at ``--open-fraction`` (0.8) of the saturation rate, the
   best request throughput the closed levels reached;
3. concurrency 1 with a different target text per request (``--texts`` of them): the
   voice's prompt prefix is a prefix-cache hit, the rest is prefilled (with one fixed
   text the whole prompt but its last block is a hit);
4. TTFA with a FRESH 3 s reference per request (encoded on the request path), one at a time;
5. concurrency 64 and 128 on a second server with the other placement (the engine and
   the vocoder in processes of their own, or all in one process with ``--split``), if the
   budget allows (``--no-other-placement`` skips it): the measurement that decides where
   the HTTP work and the engine's host loop should live;
6. the same concurrency-1 levels and concurrency 64 on a server with prefix caching off
   (``--tts_engine.factory.args.prefix_caching false``), if the budget allows
   (``--no-prefix-off`` skips it);
7. GPU memory.

Every level records the server's CPU time per request and its CPU use (CPU seconds per
wall second of the server process and its children, from ``/proc``: above 1 means more
than one thread's worth of host work), and the server's TTFA decomposition (``X-Timeline``: admission,
preprocessing, engine queue, prefill + first frame, first vocoder chunk, client), its mean
and its slowest tenth's. Every closed level (compare mode's too) also records each stage's
batches (``stage_batches``: count, mean wall ms, mean requests, from ``GET /metrics``
before and after the level, the bench's warm-up requests included; the engine's batch is
one step, recorded by kind: ``tts_engine.prefill``, ``.mixed``, ``.decode``, ``.drain``), and ``--client-processes 1 4`` runs each of them once per client-process count
against the same server. Then
``benchmarks/peers_gpu.py`` measures faster-qwen3-tts streaming TTFA (chunk 1 is its
smallest) on the first size's checkpoint, in the image's own transformers, and the ratio
of our concurrency-1 TTFA p50 to it is reported.

Compare mode (``--config NAME ROOT SERVE_ARGS``, repeated): one server per configuration,
a source tree (``ROOT``: another commit's files, ``.`` for this one) with extra serve
arguments, all started at once on the first size's checkpoint and measured one at a time
on the same machine in the same call (a bisect of commits or knobs that no two calls,
on two machines, can make as fairly): every configuration at ``--compare-concurrency``, then
the first one at the rest of ``--concurrency``, every one with a fresh reference, and the
first one with varied texts.
Writes ``..._compare.json`` and prints the configurations' levels side by side.

First it runs the suite's GPU-marked tests (``--no-gpu-tests`` skips them), so the same
call shows the CUDA paths correct. ``--budget-s`` bounds the whole run (a device call is limited): a step that would not fit
is skipped and recorded as skipped; the JSON is saved after every step. Prints a table
and writes ``OUT_DIR/qwen3_tts_gpu_<sizes>.json`` (``..._split.json`` with ``--split``: the engine and
the vocoder in processes of their own; copied to ``--copy-to`` as well) and the server
logs; every level records the GPU's mean utilization (nvidia-smi, 0.5 s samples). Run on the device (see benchmarks/README.md)::

    python benchmarks/qwen3_tts_gpu.py --out-dir $OUT --sizes 0.6b 1.7b
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile
from profiling import PySpyProfile, print_profile, stage_batch_sums, stage_batches_between

from omnistage.bench import BenchSample, SpeechTarget
from omnistage.bench.speed import SpeechResult, mean_phases, request_speech

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet green forest."
VARIED_TEXTS = [  # as long as TEXT (about the same prompt length), each different
    "A small red boat drifts slowly down the wide river, and the children wave from the old stone bridge.",
    "Every morning the baker opens his shop early, and the smell of warm bread fills the narrow street.",
    "The train leaves the station at noon, crosses the snowy mountains, and reaches the coast by evening.",
    "She painted the kitchen a bright yellow color, then hung three tiny mirrors above the wooden table.",
    "Heavy rain fell all night on the village, but by sunrise the sky was clear and the birds were singing.",
    "Our team finished the long project on time, and everyone celebrated with pizza in the meeting room.",
    "The museum keeps a giant whale skeleton in its main hall, lit from below by soft blue lamps.",
    "He forgot his umbrella at the library again, so he walked home through the park in the drizzle.",
]
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


def tiny_base_checkpoint(work: Path) -> tuple[Path, Path]:
    """A tiny random Qwen3-TTS Base checkpoint (``omnistage init-random``) and the seed-7
    3 s reference clip as WAV, written under ``work``: ``(model_dir, reference_wav_path)``
    (the CPU host-cost benchmarks' setup)."""
    model_dir = work / "qwen3_tts_tiny_base"
    subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "init-random", "--arch", "Qwen3TTSForConditionalGeneration",
         "--size", "tiny", "--type", "base", str(model_dir)],
        check=True, capture_output=True,
    )  # fmt: skip
    ref = work / "reference.wav"
    ref.write_bytes(reference_wav(7))
    return model_dir, ref


def data_uri(wav: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


def gpu_sample() -> tuple[float, float]:
    """(memory used MiB, utilization %) of GPU 0, from nvidia-smi (zeros without one: a
    CPU dry run of this script)."""
    if shutil.which("nvidia-smi") is None:
        return 0.0, 0.0
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    memory, util = out.stdout.strip().split(",")
    return float(memory), float(util)


def gpu_memory_mib() -> float:
    return gpu_sample()[0]


class GpuSampler(threading.Thread):
    """Samples nvidia-smi every 0.5 s while running: ``stop()`` returns the peak memory
    (MiB) and the mean utilization (%, the share of time a kernel ran)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.utils, self._halt = 0.0, [], threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            memory, util = gpu_sample()
            self.peak = max(self.peak, memory)
            self.utils.append(util)
            self._halt.wait(0.5)

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        return {"gpu_peak_mib": self.peak, "gpu_util_mean": float(np.mean(self.utils)) if self.utils else None}


def start_server(
    model_dir: Path, port: int, max_conc: int, log: Path, split: bool = False, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, float]:
    """``split``: the engine and the vocoder in processes of their own; ``extra``: more
    ``omnistage serve`` arguments."""
    start = time.perf_counter()
    proc = launch_server(model_dir, port, max_conc, log, split, extra)
    return proc, wait_healthy(proc, port, start, log)


def launch_server(
    model_dir: Path, port: int, max_conc: int, log: Path, split: bool = False, extra: tuple[str, ...] = (),
    root: str | None = None,
) -> subprocess.Popen:
    """Start ``omnistage serve`` (not waiting for it); ``root``: the source tree whose
    ``omnistage`` it runs (its working directory, first on its import path; None: this one)."""
    cmd = [
        sys.executable, "-m", "omnistage.cli", "serve", "--model-path", str(model_dir), "--port", str(port),
        "--allowed-local-media-path", str(model_dir.parent),
        # room for an open loop's Poisson bursts (the engine queues what it cannot run)
        "--max_concurrent_requests", str(max(4 * max_conc, 512)),
        "--tts_engine.factory.args.max_num_seqs", str(max_conc),
        "--vocoder.factory.args.num_slots", str(max_conc),
        "--log-level", "warning",
    ]  # fmt: skip
    if split:
        cmd += ["--tts_engine.process", "engine", "--vocoder.process", "vocoder"]
    cmd += list(extra)
    env = None
    if root is not None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(root).resolve()), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=root, env=env)


def wait_healthy(proc: subprocess.Popen, port: int, start: float, log: Path) -> float:
    """Seconds from ``start`` until the server on ``port`` answers /health.

    Raises:
        RuntimeError: it exited, or was not healthy within 600 s (then it is killed).
    """
    while time.perf_counter() - start < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy in 600 s")


CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live children (stage processes)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def _children(pid: int) -> list[int]:
    try:
        kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except FileNotFoundError:
        return []
    return [k for c in kids for k in (c, *_children(c))]


def with_server_cpu(server_pid: int, level_fn) -> dict:
    """Run ``level_fn()`` (a level dict) and add the server's CPU time per successful
    request (ms) and its CPU use (CPU s per wall s) over the level."""
    cpu0, t0 = process_cpu_s(server_pid), time.perf_counter()
    level = level_fn()
    cpu, wall = process_cpu_s(server_pid) - cpu0, time.perf_counter() - t0
    if "error" not in level and level.get("num_ok"):
        level["server_cpu_ms_per_request"] = round(1e3 * cpu / level["num_ok"], 2)
        level["server_cpu_use"] = round(cpu / wall, 2)
    return level


def bench_level(
    port: int, frames: int, ref: Path, out: Path, conc: int | None = None, rate: float | None = None,
    n: int | None = None, texts: tuple[str, ...] = (TEXT,), client_processes: int = 1, rounds: int = 2,
) -> dict:
    """One ``omnistage bench speed`` level: closed loop at ``conc`` or open loop at ``rate``
    requests per second (``n`` requests); ``ref`` is a WAV under the server's allowed local
    media directory (a 3 s data URI is longer than one command-line argument may be). A
    level that fails is recorded (``{"concurrency"/"rate": ..., "error": ...}``), not raised,
    so the levels after it still run. ``texts``: the target texts, cycled through.
    ``client_processes``: ``bench speed --client-processes`` of a closed level; ``rounds``:
    its requests when ``n`` is not given, in multiples of ``conc`` (at least 8 requests)."""
    fields = {"ref_audio": str(ref), "ref_text": REF_TEXT, "max_new_tokens": frames, "min_new_tokens": frames, "language": "english"}
    cmd = [
        sys.executable, "-m", "omnistage.cli", "bench", "speed", "--base-url", f"http://127.0.0.1:{port}",
        "--warmup", "2", "--stream", "--output", str(out),
    ]  # fmt: skip
    if rate is None:
        cmd += ["--concurrency", str(conc), "--num-requests", str(n or max(8, rounds * conc))]
        cmd += ["--client-processes", str(client_processes)]
    else:
        cmd += ["--rate", f"{rate:.3f}", "--num-requests", str(n)]
    for key, value in fields.items():
        cmd += ["--extra", f"{key}={json.dumps(value)}"]
    meta = out.with_suffix(".lst")
    meta.write_text("".join(f"s{i}|{REF_TEXT}||{text}\n" for i, text in enumerate(texts)), encoding="utf-8")
    cmd += ["--meta-lst", str(meta)]
    out.unlink(missing_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout[-3000:], flush=True)
    if not out.exists():  # bench speed writes its report even when some requests failed
        return {"concurrency": conc, "rate": rate, "error": (done.stdout + done.stderr)[-1500:]}
    return json.loads(out.read_text())["levels"][0]


async def fresh_reference_ttfa(port: int, frames: int, count: int) -> list[SpeechResult]:
    """``count`` sequential requests, each with a reference never seen before (so both
    reference encoders and the vocoder's left-context decode run on the request path)."""
    results = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(count):
            fields = {"ref_audio": data_uri(reference_wav(1000 + i)), "ref_text": REF_TEXT, "max_new_tokens": frames, "min_new_tokens": frames, "language": "english"}
            target = SpeechTarget(f"http://127.0.0.1:{port}", extra_fields=fields)
            result = await request_speech(client, target, BenchSample(f"fresh{i}", TEXT), stream=True)
            if not result.ok:
                raise RuntimeError(result.error)
            results.append(result)
    return results


FRESH_COST_S = 8 * (0.3 + 125 * 0.01)  # eight sequential fresh-reference requests, about


def scrape_batches(port: int) -> dict[str, dict[str, float]] | str:
    """:func:`profiling.stage_batch_sums` of the server on ``port``, or why not (a level's
    record keeps the error instead of the run stopping)."""
    try:
        return stage_batch_sums(f"http://127.0.0.1:{port}")
    except httpx.HTTPError as exc:
        return f"GET /metrics failed: {exc!r}"


def closed_level(port: int, pid: int, args: argparse.Namespace, ref: Path, out: Path, conc: int, clients: int) -> dict:
    """One closed level (:func:`bench_level`) with the server's CPU (:func:`with_server_cpu`)
    and each stage's batches during it (``stage_batches``: :func:`profiling.stage_batches_between`
    of :func:`scrape_batches` before and after; an AR engine's by step kind)."""
    before = scrape_batches(port)
    level = with_server_cpu(pid, lambda: bench_level(port, args.frames, ref, out, conc=conc, client_processes=clients, rounds=args.rounds))
    after = scrape_batches(port)
    level["stage_batches"] = (
        stage_batches_between(before, after)
        if isinstance(before, dict) and isinstance(after, dict)
        else {"error": str(before if isinstance(before, str) else after)}
    )
    return level


def fresh_reference_level(port: int, frames: int) -> dict:
    """TTFA of eight sequential requests with fresh references: p50, each, mean phases, and
    each phase's median (``phases_p50_ms``: the first request, on a new connection and cold
    shapes, weighs on the means but not on the p50)."""
    fresh = asyncio.run(fresh_reference_ttfa(port, frames, 8))
    ttfa = [r.ttfa_ms for r in fresh]
    means = mean_phases(fresh)
    medians = {name: round(float(np.median([dict(r.ttfa_phases_ms).get(name, 0.0) for r in fresh])), 2) for name in means}
    return {"p50": float(np.median(ttfa)), "all": [round(x, 1) for x in ttfa], "phases_ms": means, "phases_p50_ms": medians}


class Budget:
    """Seconds left of ``--budget-s``; ``fits(cost)`` says whether a step of about ``cost``
    seconds still fits (with the time the closing steps need kept aside)."""

    def __init__(self, total_s: float) -> None:
        self.deadline = time.perf_counter() + total_s

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, cost_s: float) -> bool:
        return self.left() > cost_s


def level_cost_s(conc: int, frames: int, rounds: int = 2) -> float:
    """A rough upper bound of one closed level's wall time: ``rounds`` rounds of requests at
    the issue's measured ~80 ms per frame at 128 streams, plus the bench client's start."""
    return 10 + rounds * frames * 0.08 * max(1, conc / 64)


def init_random(size: str, args: argparse.Namespace, record: dict) -> Path:
    """The random Base checkpoint of ``size`` (real dimensions) under ``--work-dir``."""
    model_dir = Path(args.work_dir) / f"qwen3_tts_{size}_base"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "omnistage.cli", "init-random", "--arch", "Qwen3TTSForConditionalGeneration",
         "--size", size, "--type", "base", "--device", args.device, str(model_dir)],
        check=True,
    )  # fmt: skip
    record |= {"size": size, "init_random_s": round(time.perf_counter() - t0, 1), "gpu_mib": {"before_server": gpu_memory_mib()}}
    return model_dir


def run_size(size: str, args: argparse.Namespace, record: dict, save, budget: Budget) -> Path:
    """Fill ``record`` for one size, calling ``save()`` after every step (a later failure
    or the device's time limit keeps what was measured); returns the checkpoint dir."""
    model_dir = init_random(size, args, record)
    port = 8100
    log = Path(args.out_dir) / f"server_{size}{'_split' if args.split else ''}.log"
    proc, startup_s = start_server(model_dir, port, max(args.concurrency), log, args.split)
    record["placement"] = "engine and vocoder in processes of their own" if args.split else "one process"
    record["server_startup_s"] = round(startup_s, 1)
    record["gpu_mib"]["after_startup"] = gpu_memory_mib()
    record["skipped"] = []
    save()
    try:
        ref = model_dir.parent / f"reference_{size}.wav"
        ref.write_bytes(reference_wav(7))
        record["levels"] = []
        for conc, clients in itertools.product(args.concurrency, args.client_processes):
            if not budget.fits(level_cost_s(conc, args.frames, args.rounds) + args.reserve_s):
                record["skipped"].append(f"concurrency {conc}")
                continue
            sampler = GpuSampler()
            sampler.start()
            stem = f"{size}{'_split' if args.split else ''}_c{conc}{f'_x{clients}' if clients > 1 else ''}"
            profile = level_profile(args, proc.pid, conc == max(args.concurrency), stem)
            out = Path(args.work_dir) / f"bench_{size}_c{conc}.json"
            level = closed_level(port, proc.pid, args, ref, out, conc, clients)
            record["levels"].append(level | {"client_processes": clients} | sampler.stop() | (profile.stop() if profile else {}))
            save()
        saturation = max((lv["request_throughput"] for lv in record["levels"] if "error" not in lv), default=0.0)
        record["saturation_requests_per_s"] = saturation
        rate = args.open_fraction * saturation
        n = max(16, int(rate * args.open_seconds))
        if rate > 0 and budget.fits(args.open_seconds + 2 * args.frames * 0.08 + 10 + args.reserve_s):
            sampler = GpuSampler()
            sampler.start()
            out = Path(args.work_dir) / f"bench_{size}_open.json"
            level = with_server_cpu(proc.pid, lambda: bench_level(port, args.frames, ref, out, rate=rate, n=n))
            record["open_loop"] = level | sampler.stop() | {"fraction_of_saturation": args.open_fraction}
        else:
            record["skipped"].append("open loop")
        save()
        if budget.fits(FRESH_COST_S + args.reserve_s):
            record["fresh_reference_ttfa_ms"] = fresh_reference_level(port, args.frames)
        else:
            record["skipped"].append("fresh reference")
        save()
        if budget.fits(2 * level_cost_s(1, args.frames) + args.reserve_s):
            record["varied_text_c1"] = varied_text_level(port, proc.pid, args, ref, f"{size}_varied")
        else:
            record["skipped"].append("varied texts")
        save()
    finally:
        proc.terminate()
        proc.wait(30)
    other = not args.split  # the placement the main server did not use
    place_cost = startup_s + level_cost_s(64, args.frames) + level_cost_s(128, args.frames)
    if args.other_placement and budget.fits(place_cost + args.reserve_s):
        record["other_placement"] = second_server(
            model_dir, port, args, ref, log, f"{size}_{'split' if other else 'one'}", other, (), (64, 128), varied=False
        ) | {"placement": "engine and vocoder in processes of their own" if other else "one process"}
    elif args.other_placement:
        record["skipped"].append("other placement")
    save()
    off_cost = startup_s + 3 * level_cost_s(1, args.frames) + level_cost_s(64, args.frames)
    if args.prefix_off and budget.fits(off_cost + args.reserve_s):
        off_args = ("--tts_engine.factory.args.prefix_caching", "false")
        record["prefix_caching_off"] = second_server(model_dir, port, args, ref, log, f"{size}_off", args.split, off_args, (1, 64), varied=True)
    elif args.prefix_off:
        record["skipped"].append("prefix caching off")
    save()
    return model_dir


def level_profile(args: argparse.Namespace, pid: int, highest: bool, stem: str) -> PySpyProfile | None:
    """``--py-spy``'s profile of the server ``pid`` during a level, into
    ``py_spy_<stem>.txt``: only for the ``highest`` level of a run (the highest closed level;
    in ``--config`` mode every configuration's highest ``--compare-concurrency``)."""
    if not (args.py_spy and highest):
        return None
    raw = Path(args.out_dir) / f"py_spy_{stem}.txt"
    return PySpyProfile(args.py_spy, pid, raw, args.py_spy_delay_s, args.py_spy_s, args.py_spy_gil)


def run_compare(size: str, args: argparse.Namespace, record: dict, save, budget: Budget, before_levels) -> None:
    """``--config`` mode: one server per configuration (a source tree and serve arguments),
    all started at once on one checkpoint (each with a KV pool of ``--kv-cache-gib``, as
    they share the GPU), then measured one at a time while the others idle: first every
    configuration at ``--compare-concurrency``, then the first configuration at the rest
    of ``--concurrency``, every configuration with a fresh reference, and the first with
    varied texts, as far as the budget allows. ``before_levels()`` runs once the servers are up (the GPU tests,
    run meanwhile, are waited for there)."""
    model_dir = init_random(size, args, record)
    ref = model_dir.parent / f"reference_{size}.wav"
    ref.write_bytes(reference_wav(7))
    max_conc = max(args.concurrency)
    kv = ("--tts_engine.factory.args.kv_cache_bytes", str(int(args.kv_cache_gib * 2**30)))
    start, servers = time.perf_counter(), []
    record |= {"kv_cache_gib": args.kv_cache_gib, "configs": [], "skipped": []}
    for i, (name, root, serve_args) in enumerate(args.config):
        log = Path(args.out_dir) / f"server_{size}_{name}.log"
        extra = (*kv, *shlex.split(serve_args))
        proc = launch_server(model_dir, 8100 + i, max_conc, log, extra=extra, root=None if root == "." else root)
        servers.append((8100 + i, log, proc))
        record["configs"].append({"name": name, "root": root, "serve_args": list(extra), "levels": []})
    try:
        for config, (port, log, proc) in zip(record["configs"], servers, strict=True):
            try:
                config["server_startup_s"] = round(wait_healthy(proc, port, start, log), 1)
            except RuntimeError as exc:
                config["error"] = str(exc)
        record["gpu_mib"]["after_startup"] = gpu_memory_mib()
        save()
        before_levels()
        first = record["configs"][0]
        tasks = [(c, "closed", n) for c in record["configs"] for n in args.compare_concurrency]
        tasks += [(first, "closed", n) for n in args.concurrency if n not in args.compare_concurrency]
        tasks += [(c, "fresh", 1) for c in record["configs"]] + [(first, "varied", 1)]
        for config, kind, conc in tasks:
            if "error" in config:
                continue
            port, _, proc = servers[record["configs"].index(config)]
            cost = {"closed": level_cost_s(conc, args.frames, args.rounds), "fresh": FRESH_COST_S, "varied": 2 * level_cost_s(1, args.frames)}[kind]
            if not budget.fits(cost + args.reserve_s):
                record["skipped"].append(f"{config['name']} {kind} {conc}")
                continue
            if kind == "fresh":
                config["fresh_reference_ttfa_ms"] = fresh_reference_level(port, args.frames)
            elif kind == "varied":
                config["varied_text_c1"] = varied_text_level(port, proc.pid, args, ref, f"{size}_{config['name']}_varied")
            else:
                sampler = GpuSampler()
                sampler.start()
                profile = level_profile(args, proc.pid, conc == max(args.compare_concurrency), f"{size}_{config['name']}_c{conc}")
                out = Path(args.work_dir) / f"bench_{size}_{config['name']}_c{conc}.json"
                level = closed_level(port, proc.pid, args, ref, out, conc, args.client_processes[0])
                config["levels"].append(level | sampler.stop() | (profile.stop() if profile else {}))
            save()
    finally:
        for _, _, proc in servers:
            proc.terminate()
        for config, (_, log, proc) in zip(record["configs"], servers, strict=True):
            proc.wait(30)
            # what the servers warned about (a probe that fell back to a slower path, say)
            config["log_warnings"] = [line for line in log.read_text(errors="replace").splitlines() if "WARNING" in line][:20]
        save()


def batch_line(batches: dict) -> str:
    """A level's ``stage_batches`` on one line: per stage (and engine step kind) how many,
    their mean wall ms and mean size."""
    if "error" in batches:
        return f"batches: {batches['error']}"
    return "batches: " + "  ".join(
        f"{k} {b['batches']} x {b['mean_ms']:.1f} ms (mean {b['mean_size']:.0f} requests)" for k, b in sorted(batches.items()))


def print_compare(results: dict, frames: int) -> None:
    """The ``--config`` table: each configuration's levels side by side, then their phases."""
    header = f"{'config':>16} {'load':>8} {'TTFA p50':>9} {'TTFA p99':>9} {'RTF p50':>8} {'audio s/s':>10} {'ms/frame':>9} {'GPU %':>6} {'CPU use':>8}"
    for r in results["sizes"]:
        print(f"\n{r['size']}: configurations (KV pool {r.get('kv_cache_gib')} GiB each; startup s in brackets)")
        for config in r.get("configs", []):
            print(f"  {config['name']}: root {config['root']}, serve {' '.join(config['serve_args'])} [{config.get('server_startup_s')}]")
            if "error" in config:
                print(f"    FAILED: {config['error'][-300:]}")
            for line in config.get("log_warnings", [])[:5]:
                print(f"    log: {line[-200:]}")
        print(header)
        concs = sorted({lv.get("concurrency") for c in r.get("configs", []) for lv in c["levels"]})
        for conc in concs:
            for config in r.get("configs", []):
                lv = next((x for x in config["levels"] if x.get("concurrency") == conc), None)
                if lv is None:
                    continue
                if "error" in lv:
                    print(f"{config['name']:>16} {'c=' + str(conc):>8} FAILED: {lv['error'][-200:]}")
                    continue
                print(
                    f"{config['name']:>16} {'c=' + str(conc):>8} {lv['ttfa_ms']['p50']:>9.1f} {lv['ttfa_ms']['p99']:>9.1f} "
                    f"{lv['rtf']['p50']:>8.3f} {lv['audio_throughput']:>10.1f} {lv['latency_ms']['p50'] / frames:>9.2f} "
                    f"{lv.get('gpu_util_mean') or 0:>6.0f} {lv.get('server_cpu_use', '-'):>8}"
                )
        print(f"\n{r['size']}: mean TTFA by phase, ms (phase named by the mark that ends it)")
        for config in r.get("configs", []):
            rows = []
            for lv in config["levels"]:
                if "error" not in lv:
                    rows += [(f"c={lv['concurrency']}", lv.get("ttfa_phases_ms")),
                             (f"c={lv['concurrency']} slow", lv.get("slowest_ttfa_phases_ms"))]
            if "varied_text_c1" in config and "error" not in config["varied_text_c1"]:
                rows.append(("c=1 varied", config["varied_text_c1"].get("ttfa_phases_ms")))
            if "fresh_reference_ttfa_ms" in config:
                fresh = config["fresh_reference_ttfa_ms"]
                print(f"  {config['name']}: fresh 3 s reference, c=1: TTFA p50 {fresh['p50']:.1f} ms")
                rows += [("fresh", fresh.get("phases_ms")), ("fresh p50", fresh.get("phases_p50_ms"))]
            for load, phases in rows:
                if phases:
                    print(f"  {config['name']:>16} {load:>10}: " + "  ".join(f"{k} {v:.1f}" for k, v in phases.items()))
            for lv in config["levels"]:
                if batches := lv.get("stage_batches"):
                    print(f"  {config['name']:>16} {'c=' + str(lv.get('concurrency')):>10}: {batch_line(batches)}")
            for lv in config["levels"]:
                if "py_spy" in lv:
                    print_profile(f"{r['size']} {config['name']} c={lv.get('concurrency')}", lv["py_spy"])
        if "varied_text_c1" in (r.get("configs") or [{}])[0]:
            v = r["configs"][0]["varied_text_c1"]
            if "error" not in v:
                print(f"  {r['configs'][0]['name']}: c=1 varied texts TTFA p50 {v['ttfa_ms']['p50']:.1f} p99 {v['ttfa_ms']['p99']:.1f}")
        print(f"{r['size']}: GPU MiB {r.get('gpu_mib')}; skipped {r.get('skipped')}")
    if "gpu_tests" in results:
        print(f"GPU tests: {results['gpu_tests']['summary']}")


def varied_text_level(port: int, pid: int, args: argparse.Namespace, ref: Path, tag: str) -> dict:
    """Concurrency 1, a different target text per request (the voice's prefix is shared)."""
    out = Path(args.work_dir) / f"bench_{tag}.json"
    texts = tuple(VARIED_TEXTS)
    return with_server_cpu(pid, lambda: bench_level(port, args.frames, ref, out, conc=1, n=len(texts), texts=texts))


def second_server(
    model_dir: Path, port: int, args: argparse.Namespace, ref: Path, log: Path, tag: str, split: bool,
    extra: tuple[str, ...], concs: tuple[int, ...], varied: bool,
) -> dict:
    """Another server on the same checkpoint (``split`` placement, ``extra`` serve
    arguments): the closed levels ``concs`` that ``--concurrency`` has, and with
    ``varied`` the varied-text level, to set beside the main server's. A server that does
    not start is recorded (``{"error": ...}``), not raised."""
    try:
        proc, startup_s = start_server(model_dir, port + 1, max(args.concurrency), log.with_name(f"server_{tag}.log"), split, extra)
    except RuntimeError as exc:
        return {"error": str(exc)}
    try:
        work = Path(args.work_dir)
        record: dict = {"server_startup_s": round(startup_s, 1), "serve_args": list(extra), "levels": []}
        for conc in (c for c in concs if c in args.concurrency):
            sampler = GpuSampler()
            sampler.start()
            out = work / f"bench_{tag}_c{conc}.json"
            level = with_server_cpu(proc.pid, lambda: bench_level(port + 1, args.frames, ref, out, conc=conc, client_processes=args.client_processes[0], rounds=args.rounds))  # noqa: B023 -- called at once
            record["levels"].append(level | sampler.stop())
        if varied:
            record["varied_text_c1"] = varied_text_level(port + 1, proc.pid, args, ref, f"{tag}_varied")
        return record
    finally:
        proc.terminate()
        proc.wait(30)


def run_peer(model_dir: Path, args: argparse.Namespace, results: dict, save, timeout_s: float) -> None:
    """faster-qwen3-tts on ``model_dir`` (``peers_gpu.py --only faster``), in the image's
    transformers: ``PYTHONPATH`` without the ``--tf-site`` entry that our processes use."""
    out = Path(args.out_dir) / "peers_faster.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != args.tf_site)
    t0 = time.perf_counter()
    cmd = [sys.executable, "benchmarks/peers_gpu.py", str(model_dir), "--out", str(out), "--runs", "2", "--only", "faster", "--frames", str(args.frames)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        results["peer"] = {"error": f"timed out after {timeout_s:.0f} s"}
        save()
        return
    print(done.stdout[-2500:], done.stderr[-1500:], flush=True)
    record: dict = {"wall_s": round(time.perf_counter() - t0, 1), "returncode": done.returncode}
    if out.exists():
        data = json.loads(out.read_text())
        record["records"] = [
            {k: r.get(k) for k in ("implementation", "mode", "ttfa_ms", "ms_per_frame", "rtf")} for r in data.get("records", [])
        ]
        record["errors"] = data.get("errors", [])
    results["peer"] = record
    save()


GPU_TESTS = ["tests/engine", "tests/models/qwen3_tts/test_streaming_decoder.py", "tests/pipeline/test_tensor_transport.py"]


def run_gpu_tests(timeout_s: float, paths: list[str] = GPU_TESTS) -> dict:
    """The suite's GPU-marked tests (by default: engine graphs and kernels, the fused
    prefill, the vocoder's graphs with host codes and cached contexts, CUDA IPC), so the
    same device call shows the CUDA paths are correct: ``{"returncode", "summary", "tail"}``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *paths]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"returncode": None, "summary": f"timed out after {timeout_s:g} s", "tail": ""}
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines[-15:]), flush=True)
    return {"returncode": done.returncode, "summary": lines[-1] if lines else "", "tail": "\n".join(lines[-40:])}


def _fmt_max(dist: dict) -> str:
    """A distribution's maximum (``bench speed`` records it from 2026-12-08 on; "-" in
    results written before)."""
    return "-" if dist.get("max") is None else f"{dist['max']:.3f}"


def print_table(results: dict, frames: int) -> None:
    print(f"\n{'size':6} {'load':>14} {'TTFA p50':>9} {'TTFA p99':>9} {'RTF p50':>8} {'RTF p99':>8} {'RTF max':>8} {'audio s/s':>10} {'req/s':>7} {'ms/frame':>9} {'fail':>5}")
    for r in results["sizes"]:
        levels = list(r.get("levels", [])) + ([r["open_loop"]] if "open_loop" in r else [])
        for lv in levels:
            if "error" in lv:
                load = f"c={lv['concurrency']}" if lv.get("rate") is None else f"{lv['rate']:.1f}/s"
            else:
                load = _load_name(lv) + ("" if lv.get("arrival_rate") is None else f" pk{lv['concurrency']}")
            if "error" in lv:
                print(f"{r['size']:6} {load:>14} FAILED: {lv['error'][-200:]}")
                continue
            ttfa, rtf = lv["ttfa_ms"], lv["rtf"]
            per_frame = lv["latency_ms"]["p50"] / frames
            print(
                f"{r['size']:6} {load:>14} {ttfa['p50']:>9.1f} {ttfa['p99']:>9.1f} {rtf['p50']:>8.3f} "
                f"{rtf['p99']:>8.3f} {_fmt_max(rtf):>8} {lv['audio_throughput']:>10.1f} {lv['request_throughput']:>7.2f} {per_frame:>9.2f} {lv['num_failed']:>5}"
                f"  GPU util {lv.get('gpu_util_mean') or 0:.0f}%"
            )
        cpu = "  ".join(
            f"{_load_name(lv)}: {lv['server_cpu_ms_per_request']} ms/req, use {lv['server_cpu_use']}"
            for lv in levels if "server_cpu_ms_per_request" in lv
        )
        print(f"\n{r['size']}: server CPU per request and CPU use (CPU s per wall s): {cpu}")
        print_prefix_comparison(r)
        print_placement_comparison(r)
        print(f"\n{r['size']}: mean TTFA by phase, ms (phase named by the mark that ends it)")
        for lv in levels:
            if "error" not in lv and lv.get("ttfa_phases_ms"):
                load = _load_name(lv)
                print(f"  {load:>10}: " + "  ".join(f"{k} {v:.1f}" for k, v in lv["ttfa_phases_ms"].items()))
                if slow := lv.get("slowest_ttfa_phases_ms"):
                    print(f"  {'slowest 10%':>10}: " + "  ".join(f"{k} {v:.1f}" for k, v in slow.items()))
                if batches := lv.get("stage_batches"):
                    print(f"  {'batches':>10}: {batch_line(batches)}")
        if "fresh_reference_ttfa_ms" in r:
            fresh = r["fresh_reference_ttfa_ms"]
            phases = "  ".join(f"{k} {v:.1f}" for k, v in fresh.get("phases_ms", {}).items())
            print(f"{r['size']:6} fresh 3 s reference, concurrency 1: TTFA p50 {fresh['p50']:.1f} ms ({phases})")
            medians = "  ".join(f"{k} {v:.1f}" for k, v in fresh.get("phases_p50_ms", {}).items())
            print(f"{'':6} each phase's median: {medians}")
        print(f"{r['size']:6} startup {r.get('server_startup_s')} s; GPU MiB {r.get('gpu_mib')}; skipped {r.get('skipped')}")
        for lv in levels:
            if "py_spy" in lv:
                print_profile(f"{r['size']} {_load_name(lv)}", lv["py_spy"])
    if "gpu_tests" in results:
        print(f"GPU tests: {results['gpu_tests']['summary']}")
    peer = results.get("peer")
    if peer:
        for rec in peer.get("records", []):
            print(f"peer {rec['implementation']} {rec['mode']}: TTFA {rec['ttfa_ms']} ms, {rec['ms_per_frame']} ms/frame, RTF {rec['rtf']}")
        if "ttfa_ratio_ours_to_peer_chunk1" in results:
            print(f"our c=1 TTFA p50 / faster-qwen3-tts streaming chunk 1 TTFA: {results['ttfa_ratio_ours_to_peer_chunk1']:.3f}")
        for err in [*peer.get("errors", []), *([peer["error"]] if "error" in peer else [])]:
            print(f"peer error: {err}")


def _load_name(lv: dict) -> str:
    if lv.get("arrival_rate") is not None:
        return f"{lv['arrival_rate']:.1f}/s"
    clients = lv.get("client_processes", 1)
    return f"c={lv['concurrency']}" + (f" x{clients}" if clients > 1 else "")


def print_prefix_comparison(r: dict) -> None:
    """TTFA p50 / p99 with prefix caching on and off, level by level."""

    def ttfa(lv: dict | None) -> str:
        if not lv or "error" in lv:
            return "-"
        return f"{lv['ttfa_ms']['p50']:.1f} / {lv['ttfa_ms']['p99']:.1f}"

    off = r.get("prefix_caching_off", {})
    rows = [("c=1 same text", "c", 1), ("c=64 same text", "c", 64), ("c=1 varied texts", "v", 1)]
    print(f"{r['size']}: prefix caching (known voice), TTFA p50 / p99 ms:  on | off")
    for name, kind, conc in rows:
        if kind == "c":
            on_lv = next((lv for lv in r.get("levels", []) if lv.get("concurrency") == conc), None)
            off_lv = next((lv for lv in off.get("levels", []) if lv.get("concurrency") == conc), None)
        else:
            on_lv, off_lv = r.get("varied_text_c1"), off.get("varied_text_c1")
        print(f"  {name:>18}: {ttfa(on_lv):>16} | {ttfa(off_lv)}")


def print_placement_comparison(r: dict) -> None:
    """The main server's placement beside the other one, at the levels both ran."""
    other = r.get("other_placement")
    if not other:
        return
    if "error" in other:
        print(f"{r['size']}: other placement did not start: {other['error'][-300:]}")
        return
    print(f"{r['size']}: placement, TTFA p50 / p99 ms, audio s/s, server CPU use:  {r.get('placement')} | {other['placement']}")
    for lv in other["levels"]:
        main_lv = next((m for m in r.get("levels", []) if m.get("concurrency") == lv.get("concurrency")), None)

        def cell(x: dict | None) -> str:
            if not x or "error" in x:
                return "-"
            return f"{x['ttfa_ms']['p50']:.1f} / {x['ttfa_ms']['p99']:.1f}, {x['audio_throughput']:.1f}, {x.get('server_cpu_use')}"

        print(f"  c={lv.get('concurrency')}: {cell(main_lv)} | {cell(lv)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--copy-to", default="benchmarks/results", help="also copy the JSON here")
    parser.add_argument("--work-dir", default="/tmp")
    parser.add_argument("--sizes", nargs="+", default=["0.6b", "1.7b"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--frames", type=int, default=125)
    parser.add_argument("--open-fraction", type=float, default=0.8)
    parser.add_argument("--open-seconds", type=float, default=12.0, help="seconds of open-loop arrivals")
    parser.add_argument("--budget-s", type=float, default=520.0)
    parser.add_argument("--reserve-s", type=float, default=20.0, help="kept for saving and the closing steps")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--py-spy", metavar="BIN", help="profile the server with this py-spy binary during the highest closed level; with --config, each configuration's highest --compare-concurrency level (see PySpyProfile)")
    parser.add_argument("--py-spy-s", type=float, default=8.0, help="seconds the --py-spy profile samples")
    parser.add_argument("--py-spy-delay-s", type=float, default=3.0, help="seconds into the level the --py-spy profile starts")
    parser.add_argument("--rounds", type=int, default=2, help="requests of a closed level in multiples of its concurrency (one round: one burst at a closed loop's start)")
    parser.add_argument("--client-processes", type=int, nargs="+", default=[1], help="bench speed --client-processes of the closed levels; several: each level once per value, in turn, against the same server (the other configurations and placements take the first)")
    parser.add_argument("--py-spy-gil", action="store_true", help="sample only the thread holding the GIL (py-spy --gil)")
    parser.add_argument("--gpu-tests", action=argparse.BooleanOptionalAction, default=True, help="run the GPU-marked tests first")
    parser.add_argument("--gpu-tests-timeout-s", type=float, default=150.0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the whole script on a tiny checkpoint (--sizes tiny --no-peer)")
    parser.add_argument("--split", action="store_true", help="serve with the engine and the vocoder in processes of their own")
    parser.add_argument("--peer-timeout-s", type=float, default=150.0)
    parser.add_argument("--other-placement", action=argparse.BooleanOptionalAction, default=True, help="also serve with the other placement (one process vs --split) at concurrency 64 and 128")
    parser.add_argument("--prefix-off", action=argparse.BooleanOptionalAction, default=True, help="also serve with prefix caching off (a second start-up) for the on/off comparison")
    parser.add_argument("--tf-site", default="/tmp/site_tf", help="PYTHONPATH entry of transformers 5.24 (dropped for the peer)")
    parser.add_argument("--gpu-test-paths", nargs="+", default=GPU_TESTS, help="the test files or folders --gpu-tests runs")
    parser.add_argument(
        "--config", nargs=3, action="append", metavar=("NAME", "ROOT", "SERVE_ARGS"),
        help="compare mode (repeat it): a server running the omnistage of source tree ROOT ('.': this one) "
        "with the extra serve arguments SERVE_ARGS (one shell-quoted string, may be empty); see run_compare",
    )
    parser.add_argument("--compare-concurrency", type=int, nargs="+", default=[1, 64], help="closed levels every --config runs")
    parser.add_argument("--kv-cache-gib", type=float, default=6.0, help="each --config server's KV pool (they share the GPU)")
    args = parser.parse_args()
    budget = Budget(args.budget_s)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"frames": args.frames, "sizes": []}

    name = f"qwen3_tts_gpu_{'_'.join(args.sizes)}{'_split' if args.split else ''}{'_compare' if args.config else ''}.json"

    def save() -> None:
        (out_dir / name).write_text(json.dumps(results, indent=2))
        if args.copy_to and Path(args.copy_to).is_dir():
            shutil.copy(out_dir / name, Path(args.copy_to) / name)

    if args.config:
        compare(args, results, save, budget)
        return

    if args.gpu_tests:
        results["gpu_tests"] = run_gpu_tests(min(args.gpu_tests_timeout_s, budget.left() / 4), args.gpu_test_paths)
        save()
    first_model: Path | None = None
    for i, size in enumerate(args.sizes):
        # a size needs its start-up (~2 min for 0.6b, more for 1.7b) and a few levels
        peer_s = args.peer_timeout_s if args.peer and i == 0 else 0
        if i > 0 and not budget.fits(180 + peer_s + args.reserve_s):
            results.setdefault("skipped", []).append(f"size {size}")
            continue
        results["sizes"].append({})
        model_dir = run_size(size, args, results["sizes"][-1], save, budget)
        first_model = first_model or model_dir
        if i == 0 and args.peer and budget.fits(60 + args.reserve_s):
            run_peer(model_dir, args, results, save, min(args.peer_timeout_s, budget.left() - args.reserve_s))
    peer = results.get("peer", {})
    chunk1 = next((r["ttfa_ms"] for r in peer.get("records", []) if r["mode"] == "streaming chunk 1"), None)
    ours = next((lv["ttfa_ms"]["p50"] for lv in results["sizes"][0].get("levels", []) if lv.get("concurrency") == 1 and "error" not in lv), None) if results["sizes"] else None
    if chunk1 and ours:
        results["ttfa_ratio_ours_to_peer_chunk1"] = ours / chunk1
    save()
    print_table(results, args.frames)


def compare(args: argparse.Namespace, results: dict, save, budget: Budget) -> None:
    """``--config`` mode for the first of ``--sizes``; the GPU tests (``--gpu-tests``) run
    while the servers start and are waited for before the first level."""
    tests = None
    if args.gpu_tests:
        timeout = min(args.gpu_tests_timeout_s, budget.left() / 4)
        tests = threading.Thread(target=lambda: results.__setitem__("gpu_tests", run_gpu_tests(timeout, args.gpu_test_paths)))
        tests.start()

    def before_levels() -> None:
        if tests is not None:
            tests.join()
            save()

    results["sizes"].append({})
    try:
        run_compare(args.sizes[0], args, results["sizes"][-1], save, budget, before_levels)
    finally:
        before_levels()
        save()
        print_compare(results, args.frames)


if __name__ == "__main__":
    main()
