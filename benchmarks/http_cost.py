"""CPU cost of the HTTP side of a served speech model, per audio second and per streamed chunk.

The served bound measured on the H200 at concurrency 128 (benchmarks/README.md, Qwen3-TTS
section) is the server process's host work: its Python threads share one GIL, so every CPU
second the HTTP side spends on a streamed chunk is taken from the engine's and the
vocoder's host loops, and it delays the chunks of every other stream. This script measures
that cost on a CPU. It serves a model with ``omnistage serve`` once per configuration
(``--config NAME ROOT SERVE_ARGS``: a source tree, ``.`` for this one, and extra serve
arguments; all servers started at once, measured one at a time while the others idle,
rounds alternating), drives closed-loop levels (pcm, exactly ``--frames`` frames per
request; streamed, or whole responses with ``--no-stream``) from this process with :func:`omnistage.bench.speed.run_speed`, and reads,
before and after each level, the CPU time of every server thread
(``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a CPU), of this process (the client,
``time.process_time``) and the server's ``first_byte`` phase (``/metrics``).

Models (``--model``):

- ``paced`` (default): ``paced_speech.py``, a stage that costs nothing but streams pcm at
  Qwen3-TTS's chunk sizes (1, 2, 4, then 8 frames of 80 ms at 24 kHz) and pace (one frame
  per stream every ``--step-ms``, all streams' chunks of a step as one message, as the
  vocoder sends them): the serving path alone, so its cost is measured without the noise
  of a model's compute on the same two cores, and a wall-clock throughput bound by it;
- ``qwen3-tts``: a tiny random Qwen3-TTS Base (voice clone with a cached reference): the
  real pipeline, whose CPU compute takes most of the machine.

``--body-kib N`` (paced only) pads every request body with N KiB (the paced request's
ignored ``padding`` field), to measure the cost of reading and parsing a large body.

Threads are named with ``py-spy dump`` (``pip install py-spy``) and grouped as ``loop``
(``MainThread``: the asyncio loop, which runs the coordinator's event handling, the
responses and the sockets) and ``workers`` (AnyIO worker threads: ``run_in_threadpool``,
e.g. request parsing). Reported per level:

- ``loop_ms_per_audio_s``, ``loop_us_per_chunk``: the loop's CPU per second of audio
  delivered and per vocoder chunk (chunks per request from the chunk plan: 18 for 125
  frames); ``workers_ms_per_request``; ``client_ms_per_audio_s``: this process's CPU;
- ``loop_ms_per_request``, ``server_ms_per_request`` (loop + workers): the HTTP side's CPU
  per request;
- TTFA p50 / p99, its ``client`` phase (the client's TTFA after the server's last
  ``X-Timeline`` mark) and the server's mean ``first_byte`` phase (the last mark to the
  first byte handed to the response), latency p50 / p99, audio throughput, requests per
  second.

Per configuration and level the summary is the median over the ``--rounds`` of each
figure, and of its ratio to the first configuration's in the same round. Prints a table with the ratios of each configuration to the first (streamed: per
audio second and chunk; ``--no-stream``: per request), and writes ``--output``::

    python benchmarks/http_cost.py --config before /path/to/main '' --config after . '' \\
        --output benchmarks/results/http_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import paced_speech  # noqa: E402
from qwen3_tts_gpu import REF_TEXT, TEXT, tiny_base_checkpoint  # noqa: E402 -- the same requests as the GPU run

from omnistage.bench import BenchSample, SpeechTarget  # noqa: E402
from omnistage.bench.speed import SpeedOptions, run_speed  # noqa: E402
from omnistage.scheduling.vocoder import ChunkPlan  # noqa: E402
from omnistage.testing.waits import free_port  # noqa: E402

PHASE_SUM = re.compile(r'omnistage_request_phase_seconds_(sum|count)\{phase="first_byte"\} (\S+)')


@dataclass(frozen=True)
class Model:
    """What is served: its checkpoint, serve arguments, environment and request fields."""

    model_dir: Path
    serve_args: list[str]
    env: dict[str, str]
    fields: dict[str, object]
    python_path: tuple[Path, ...] = ()


def paced_model(work: Path, frames: int, step_ms: float, body_kib: int) -> Model:
    return Model(
        paced_speech.write_checkpoint(work / "paced_speech"),
        ["--vocoder.factory.args.step_ms", str(step_ms)],
        {"OMNISTAGE_EXTRA_MODELS": "paced_speech:PacedSpeechConfig"},
        {"frames": frames, **({"padding": "x" * (1024 * body_kib)} if body_kib else {})},
        (HERE,),
    )


def qwen3_tts_model(work: Path, frames: int, conc: int) -> Model:
    model_dir, ref = tiny_base_checkpoint(work)
    fields = {
        "ref_audio": str(ref),
        "ref_text": REF_TEXT,
        "max_new_tokens": frames,
        "min_new_tokens": frames,
        "language": "english",
    }
    serve_args = [
        "--tts_engine.factory.args.max_num_seqs",
        str(conc),
        "--vocoder.factory.args.num_slots",
        str(conc),
    ]
    return Model(model_dir, serve_args, {}, fields)


@dataclass(frozen=True)
class Config:
    name: str
    root: Path
    serve_args: list[str]


@dataclass
class Server:
    config: Config
    port: int
    proc: subprocess.Popen


def chunks_per_request(frames: int) -> int:
    """Vocoder chunks of a stream of ``frames`` frames under the default chunk plan."""
    plan, count, done = ChunkPlan(), 0, 0
    while done < frames:
        done += plan.size(count)
        count += 1
    return count


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds on a CPU of every thread of ``pid`` (schedstat's first field)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by OS thread id (``py-spy dump --json``)."""
    done = subprocess.run(
        ["py-spy", "dump", "--json", "-p", str(pid)], capture_output=True, text=True, check=True
    )
    return {
        t["os_thread_id"]: t.get("thread_name") or "?"
        for t in json.loads(done.stdout)
        if t.get("os_thread_id")
    }


def start(config: Config, model: Model, port: int, log: Path) -> Server:
    cmd = [
        sys.executable, "-m", "omnistage.cli", "serve", "--model-path", str(model.model_dir), "--port", str(port),
        "--allowed-local-media-path", str(model.model_dir.parent), "--max_concurrent_requests", "512",
        "--log-level", "warning", *model.serve_args, *config.serve_args,
    ]  # fmt: skip
    python_path = os.pathsep.join(str(p) for p in (config.root.resolve(), *model.python_path))
    env = {**os.environ, **model.env, "PYTHONPATH": python_path}
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=config.root
    )
    return Server(config, port, proc)


def wait_healthy(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server {server.config.name} exited with {server.proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server {server.config.name} did not become healthy")


def bench(port: int, conc: int, n: int, model: Model, stream: bool) -> tuple[dict, float]:
    """One closed level, driven from this process; returns its stats and this process's
    CPU seconds during it (the client's cost)."""
    target = SpeechTarget(f"http://127.0.0.1:{port}", extra_fields=model.fields)
    options = SpeedOptions(
        target, concurrencies=(conc,), num_requests=n, warmup=0, stream=stream, show_progress=False
    )
    cpu = time.process_time()
    report = asyncio.run(run_speed(options, [BenchSample("s0", TEXT)]))
    client_s = time.process_time() - cpu
    level = report.to_dict()["levels"][0]
    if level["num_failed"]:
        raise RuntimeError(f"{level['num_failed']} requests failed: {level['errors']}")
    return level, client_s


def first_byte_phase(port: int) -> tuple[float, float]:
    """The server's ``first_byte`` phase histogram: (sum of seconds, count)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = dict(PHASE_SUM.findall(text))
    return float(values.get("sum", 0)), float(values.get("count", 0))


def measure(server: Server, conc: int, n: int, frames: int, model: Model, stream: bool) -> dict:
    pid = server.proc.pid
    names = thread_names(pid)
    phase_before = first_byte_phase(server.port)
    before = thread_cpu_ns(pid)
    level, client_s = bench(server.port, conc, n, model, stream)
    after = thread_cpu_ns(pid)
    phase_after = first_byte_phase(server.port)
    first_byte_ms = (
        1e3 * (phase_after[0] - phase_before[0]) / max(1.0, phase_after[1] - phase_before[1])
    )
    names.update(thread_names(pid))  # AnyIO workers started during the level
    groups = {"loop": 0, "workers": 0}
    for tid, ns in after.items():
        name = names.get(tid)
        group = (
            "loop"
            if name == "MainThread"
            else "workers"
            if name and name.startswith("AnyIO worker")
            else None
        )
        if group is not None:
            groups[group] += ns - before.get(tid, 0)
    ok, audio_s = level["num_ok"], level["audio_s_total"]
    chunks = ok * chunks_per_request(frames)
    server_ns = groups["loop"] + groups["workers"]
    return {
        "config": server.config.name, "concurrency": conc, "requests_ok": ok, "audio_s": round(audio_s, 1),
        "chunks": chunks, "loop_cpu_s": round(groups["loop"] / 1e9, 3), "workers_cpu_s": round(groups["workers"] / 1e9, 3),
        "loop_ms_per_audio_s": round(groups["loop"] / 1e6 / audio_s, 3),
        "loop_us_per_chunk": round(groups["loop"] / 1e3 / chunks, 1),
        "workers_ms_per_request": round(groups["workers"] / 1e6 / ok, 3),
        "client_ms_per_audio_s": round(1e3 * client_s / audio_s, 3),
        "loop_ms_per_request": round(groups["loop"] / 1e6 / ok, 3), "server_ms_per_request": round(server_ns / 1e6 / ok, 3),
        "ttfa_p50_ms": round(level["ttfa_ms"]["p50"], 1), "ttfa_p99_ms": round(level["ttfa_ms"]["p99"], 1),
        "latency_p50_ms": round(level["latency_ms"]["p50"], 2), "latency_p99_ms": round(level["latency_ms"]["p99"], 2),
        "requests_per_s": round(level["request_throughput"], 1),
        "client_phase_ms": round(level.get("ttfa_phases_ms", {}).get("client", float("nan")), 1),
        "first_byte_phase_ms": round(first_byte_ms, 2),
        "audio_throughput": round(level["audio_throughput"], 2), "wall_s": round(level["wall_s"], 1),
    }  # fmt: skip


KEYS = (
    "loop_ms_per_audio_s",
    "loop_us_per_chunk",
    "workers_ms_per_request",
    "client_ms_per_audio_s",
    "loop_ms_per_request",
    "server_ms_per_request",
    "ttfa_p50_ms",
    "ttfa_p99_ms",
    "client_phase_ms",
    "first_byte_phase_ms",
    "latency_p50_ms",
    "latency_p99_ms",
    "audio_throughput",
    "requests_per_s",
)


def summarize(levels: list[dict], configs: list[Config], concurrencies: list[int]) -> list[dict]:
    """Per configuration and concurrency: the median of each figure over the rounds, its
    ratio to the first configuration's median (``ratio``), and the median over the rounds
    of its ratio to the first configuration's figure in the same round (``paired_ratio``:
    a round measures every configuration within a minute, so a load that changes between
    rounds on a shared machine cancels out)."""
    rows = []
    for conc in concurrencies:
        by_config = {
            config.name: {
                lv["round"]: lv
                for lv in levels
                if lv["config"] == config.name and lv["concurrency"] == conc
            }
            for config in configs
        }
        base_rounds = by_config[configs[0].name]
        base = None
        for config in configs:
            mine = by_config[config.name]
            row = {"config": config.name, "concurrency": conc, "rounds": len(mine)}
            for key in KEYS:
                row[key] = round(statistics.median(lv[key] for lv in mine.values()), 3)
            base = base or row
            row["ratio"] = {key: round(row[key] / base[key], 3) for key in KEYS if base[key]}
            row["paired_ratio"] = {
                key: round(statistics.median(mine[r][key] / base_rounds[r][key] for r in mine), 3)
                for key in KEYS
                if all(base_rounds[r][key] for r in mine)
            }
            rows.append(row)
    return rows


def _with_ratio(row: dict, key: str, spec: str) -> str:
    """One table cell: `` value (ratio to the first configuration)x``."""
    return f" {row[key]:{spec}} ({row['ratio'].get(key, 0):.2f}x)"


def print_whole_table(rows: list[dict]) -> None:
    print(
        f"{'config':<10} {'c':>4} {'server ms/req':>14} {'loop ms/req':>14} {'workers ms/req':>15}"
        f" {'latency p50/p99 ms':>19} {'req/s':>15}"
    )
    for r in rows:
        print(
            f"{r['config']:<10} {r['concurrency']:>4}"
            f"{_with_ratio(r, 'server_ms_per_request', '>6.3f')}{_with_ratio(r, 'loop_ms_per_request', '>6.3f')}"
            f"{_with_ratio(r, 'workers_ms_per_request', '>7.3f')}"
            f" {r['latency_p50_ms']:>9.2f}/{r['latency_p99_ms']:<9.2f}{_with_ratio(r, 'requests_per_s', '>7.1f')}"
        )


def print_table(rows: list[dict]) -> None:
    print(
        f"{'config':<10} {'c':>4} {'loop ms/audio s':>16} {'loop us/chunk':>14} {'workers ms/req':>15}"
        f" {'client ms/audio s':>18} {'TTFA p50/p99 ms':>17} {'client/first_byte ms':>21} {'audio s/s':>9}"
    )
    for r in rows:
        print(
            f"{r['config']:<10} {r['concurrency']:>4}"
            f"{_with_ratio(r, 'loop_ms_per_audio_s', '>8.3f')}{_with_ratio(r, 'loop_us_per_chunk', '>6.0f')}"
            f"{_with_ratio(r, 'workers_ms_per_request', '>7.2f')}{_with_ratio(r, 'client_ms_per_audio_s', '>10.2f')}"
            f" {r['ttfa_p50_ms']:>8.0f}/{r['ttfa_p99_ms']:<8.0f}"
            f" {r['client_phase_ms']:>10.1f}/{r['first_byte_phase_ms']:<10.2f} {r['audio_throughput']:>9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", nargs=3, action="append", metavar=("NAME", "ROOT", "SERVE_ARGS"),
                        help="a configuration: name, source tree, extra serve arguments (one shell-quoted string)")  # fmt: skip
    parser.add_argument("--model", choices=("paced", "qwen3-tts"), default="paced")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=25.0,
        help="paced: ms per engine step (one frame per stream)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 128])
    parser.add_argument(
        "--requests", type=int, default=0, help="requests per level (0: twice the concurrency)"
    )
    parser.add_argument("--frames", type=int, default=125)
    parser.add_argument(
        "--no-stream", action="store_true", help="whole-response requests (default: streamed)"
    )
    parser.add_argument(
        "--body-kib", type=int, default=0, help="paced: pad every request body with N KiB"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="first server's port, the next ones following (0: ports free now, the kernel's pick)",
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.body_kib < 0 or (args.body_kib and args.model != "paced"):
        parser.error("--body-kib takes N >= 0 and needs --model paced")
    stream = not args.no_stream
    configs = [
        Config(n, Path(r), shlex.split(a)) for n, r, a in (args.config or [("this", ".", "")])
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model == "paced":
            model = paced_model(work, args.frames, args.step_ms, args.body_kib)
        else:
            model = qwen3_tts_model(work, args.frames, max(args.concurrency))
        ports = [args.port + i if args.port else free_port() for i in range(len(configs))]
        servers = [
            start(c, model, port, work / f"server_{c.name}.log")
            for c, port in zip(configs, ports, strict=True)
        ]
        levels = []
        try:
            deadline = time.monotonic() + 300
            for server in servers:
                wait_healthy(server, deadline)
                bench(server.port, 8, 16, model, stream)  # warm-up
            for round_ in range(args.rounds):
                for server in servers if round_ % 2 == 0 else servers[::-1]:
                    for conc in args.concurrency:
                        n = args.requests or 2 * conc
                        level = measure(server, conc, n, args.frames, model, stream)
                        levels.append({**level, "round": round_})
                        print(json.dumps(level), flush=True)
        finally:
            for server in servers:
                server.proc.terminate()
            for server in servers:
                server.proc.wait(30)
    rows = summarize(levels, configs, args.concurrency)
    (print_table if stream else print_whole_table)(rows)
    report = {
        "command": " ".join(shlex.quote(a) for a in sys.argv), "model": args.model, "frames": args.frames,
        "stream": stream, "body_kib": args.body_kib,
        "step_ms": args.step_ms if args.model == "paced" else None, "chunks_per_request": chunks_per_request(args.frames),
        "configs": [{"name": c.name, "root": str(c.root), "serve_args": c.serve_args} for c in configs],
        "summary": rows, "levels": levels,
    }  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
