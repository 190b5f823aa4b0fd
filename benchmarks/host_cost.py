"""Host CPU time per streamed request, by thread, of a served Qwen3-TTS (CPU, no GPU needed).

The served bound measured on the H200 (benchmarks/README.md) is the host: the HTTP
process writing streams and the stage hosts' per-request-per-step Python work, not the
GPU. On a CPU the model's own compute dominates the wall clock, so wall times cannot show
that work; CPU time can. This script serves a tiny random Qwen3-TTS Base with
``omnistage serve``, drives one closed-loop level with ``omnistage bench speed``
(streaming pcm, voice clone with a cached reference, ``--frames`` frames per request)
and reads every thread's CPU time (``/proc/<pid>/task/<tid>/stat``, utime + stime) before
and after the level. Threads are named with ``py-spy dump`` (``pip install py-spy``), and
grouped:

- ``http``: the asyncio loop (``MainThread``: coordinator, responses, sockets) and the
  AnyIO worker threads (``run_in_threadpool``);
- ``stage-<name>``: a stage's compute thread (the engine's and the vocoder's include the
  model's compute, which on a CPU is most of it);
- ``preprocessing workers`` (a threaded preprocessing stage's pool, as Qwen3-TTS's was
  before its stage became one batching thread, ``stage-preprocessing``); ``native``:
  threads Python does not know (torch's intra-op pool, ZMQ);
- with stage processes (e.g. ``--serve-arg=--tts_engine.process --serve-arg=engine``),
  their stage threads by name, their other Python threads (``stage process plumbing``:
  the ZMQ sender and receiver, the main thread) and their native threads.

It prints and writes (``--output``) CPU milliseconds per request per group. The numbers
compare two runs on the same machine (e.g. main against a branch); they are not absolute.

    python benchmarks/host_cost.py --output /tmp/host_cost.json

``--prepare``: the CPU of the HTTP side's request preparation alone (``SpeechServer.prepare``:
parse, validate, build the typed request; what every request costs the server's worker
threads before it reaches the pipeline), by part, without a server: each ``--config NAME
ROOT`` (a source tree; ``.`` for this one) runs in a process of its own importing ROOT, in
``--rounds`` rounds alternating the configurations, on the tiny random Base checkpoint with
the same 3 s reference as the GPU run, sent again and again (a cached reference) as a local
path (what ``qwen3_tts_gpu.py`` sends), as a data URI, and as a saved voice. Each part is
the thread CPU time (``time.thread_time_ns``) of a function both trees have, wrapped:
``parse`` (JSON + schema), ``validate`` (capabilities), ``reference`` (``load_reference``:
read, decode, check, resample, or the cache), ``fits`` (``_check_fits``: the prompt's size
from token ids), ``saved voice`` (the library look-up); ``other`` is the rest of ``prepare``.

A fourth form, ``fresh data URI``, sends a clip never seen before with every prepare (what
``qwen3_tts_gpu.py``'s fresh-reference level sends: a new seeded 3 s clip as a data URI),
``--fresh-iterations`` of them per round: the whole load runs (no cache hit) and its decode
runs in a decoder worker process, whose CPU the thread's clock does not see; so every part
is also timed by the wall clock (``time.perf_counter_ns``), and ``reference`` is split into
``key`` (``_content_key``: the SHA-256), ``source`` (``_read_source``: the data URI's base64
decoding), ``decode`` (``decode_audio``: the job's round trip to the decoder worker and its
decoding there), ``check`` (``check_reference``) and ``resample``.

    python benchmarks/host_cost.py --prepare --config before /tmp/before --config after . \\
      --output /tmp/prepare_cost.json

``--prompt``: the preprocessing stage's talker prompt alone (``PromptBuilder``, on the
tiny random Base and CustomVoice checkpoints, fp32, one torch thread), per ``--config``
tree as for ``--prepare``: thread CPU microseconds per prompt and the aten ops one prompt
dispatches (views and no-op ``to`` s included, each other op a kernel launch on CUDA; a
CPU run cannot show the waits of blocking copies on a busy CUDA stream), for the served
modes' defaults: ``icl`` (the voice clone of the GPU run: its texts, a 3 s reference's 38
frames of codes, streaming text), ``x_vector`` (streaming text) and ``custom_voice``
(voice aiden, whole text), each built again and again (the same voice); in a tree whose
builder has ``whole_many`` also ``icl_batch32``: 32 such voice-clone prompts (heads and
texts) built as the preprocessing stage builds a batch, per prompt, and
``icl_batch32_known_head``: the same with the voice's head made once before (the stage's
head cache hit: only the texts are built), and ``icl_batch32_known_ids``: the same with the
text's token ids made before too (the request builder's, which the stage takes from the
request: only the text rows are built). These two time ``whole_many`` given a kept head
(and ids) in any tree that has it, not what that tree's stage does.

    python benchmarks/host_cost.py --prompt --config before /tmp/before --config after . \\
      --output /tmp/prompt_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_tts_gpu import REF_TEXT, TEXT, tiny_base_checkpoint  # noqa: E402 -- the same requests as the GPU run

CLK_TCK = os.sysconf("SC_CLK_TCK")


def server_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (a split placement's stage processes)."""
    try:
        kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except FileNotFoundError:
        return [pid]
    return [pid, *(p for kid in kids for p in server_pids(kid))]


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of ``pid``, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by OS thread id (``py-spy dump --json``)."""
    done = subprocess.run(["py-spy", "dump", "--json", "-p", str(pid)], capture_output=True, text=True, check=True)
    return {t["os_thread_id"]: t.get("thread_name") or "?" for t in json.loads(done.stdout) if t.get("os_thread_id")}


def group_of(name: str | None, child: bool) -> str:
    if name is None:
        return "native (stage processes)" if child else "native"
    if child:  # a stage process: its stage threads keep their names, the rest is plumbing
        return name if name.startswith("stage-") else "stage process plumbing"
    if name == "MainThread" or name.startswith("AnyIO worker"):
        return "http"
    if name.startswith("preprocessing-w"):
        return "preprocessing workers"
    return name


def serve(model_dir: Path, port: int, conc: int, log: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "omnistage.cli", "serve", "--model-path", str(model_dir), "--port", str(port),
        "--allowed-local-media-path", str(model_dir.parent), "--max_concurrent_requests", "512",
        "--tts_engine.factory.args.max_num_seqs", str(conc), "--vocoder.factory.args.num_slots", str(conc),
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in 300 s")


def bench(port: int, conc: int, n: int, frames: int, ref: Path, out: Path, warmup: int) -> dict:
    meta = out.with_suffix(".lst")
    meta.write_text(f"s0|{REF_TEXT}||{TEXT}\n", encoding="utf-8")
    fields = {"ref_audio": str(ref), "ref_text": REF_TEXT, "max_new_tokens": frames, "min_new_tokens": frames, "language": "english"}
    cmd = [
        sys.executable, "-m", "omnistage.cli", "bench", "speed", "--base-url", f"http://127.0.0.1:{port}",
        "--warmup", str(warmup), "--stream", "--concurrency", str(conc), "--num-requests", str(n),
        "--output", str(out), "--meta-lst", str(meta),
    ]  # fmt: skip
    for key, value in fields.items():
        cmd += ["--extra", f"{key}={json.dumps(value)}"]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.read_text())["levels"][0]


#: (part, module, attribute) wrapped by ``--prepare``: functions every compared tree has.
PREPARE_PARTS = (
    ("parse", "omnistage.serve.app", "parse_speech_request"),
    ("validate", "omnistage.serve.app", "validate_speech_request"),
    ("reference", "omnistage.models.qwen3_tts.request_builders", "load_reference"),
    ("fits", "omnistage.models.qwen3_tts.request_builders", "_check_fits"),
)
#: (part, module, attribute) inside ``reference`` wrapped by ``--prepare`` (the fresh form
#: runs them all; a cached clip only ``key``).
REFERENCE_PARTS = (
    ("key", "omnistage.serve.media", "_content_key"),
    ("source", "omnistage.serve.media", "_read_source"),
    ("decode", "omnistage.serve.media", "decode_audio"),
    ("check", "omnistage.models.qwen3_tts.request_builders", "check_reference"),
    ("resample", "omnistage.serve.media", "resample"),
)
FRESH = "fresh data URI"
PREPARE_FORMS = ("path", "data URI", "saved voice", FRESH)


def prepare_worker(iterations: int, fresh_iterations: int) -> dict:
    """In this process (its ``omnistage`` is the tree under test): mean thread CPU and wall
    microseconds per ``SpeechServer.prepare`` of each reference form, by part."""
    import functools
    import importlib

    from qwen3_tts_gpu import data_uri, reference_wav

    import omnistage
    from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
    from omnistage.serve.app import SpeechServer
    from omnistage.serve.media import MediaPolicy
    from omnistage.serve.server_core import ServerSettings

    spent: dict[str, int] = {}
    walls: dict[str, int] = {}

    def timed(part: str, fn):
        @functools.wraps(fn)  # the check's name is part of the reference's content key
        def wrapper(*args, **kwargs):
            t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] = spent.get(part, 0) + time.thread_time_ns() - t0
                walls[part] = walls.get(part, 0) + time.perf_counter_ns() - w0

        return wrapper

    for part, module, name in (*PREPARE_PARTS, *REFERENCE_PARTS):
        target = importlib.import_module(module)
        setattr(target, name, timed(part, getattr(target, name)))
    SpeechServer.with_saved_voice = timed("saved voice", SpeechServer.with_saved_voice)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, ref = tiny_base_checkpoint(work)
        wav = ref.read_bytes()
        policy = MediaPolicy(allowed_local_media_path=work)
        settings = ServerSettings(media_policy=policy, warmup=False, data_dir=work / "data")
        server = SpeechServer(Qwen3TTSPipelineConfig.for_model_path(str(model_dir)), settings)
        assert server.library is not None
        server.library.add("", "saved", "test", REF_TEXT, "audio/wav", wav)
        common = {"input": TEXT, "max_new_tokens": 125, "min_new_tokens": 125, "language": "english",
                  "stream": True, "response_format": "pcm"}  # fmt: skip
        clone = {"ref_text": REF_TEXT}
        bodies = {
            "path": {**common, **clone, "ref_audio": str(work / "reference.wav")},
            "data URI": {**common, **clone, "ref_audio": data_uri(wav)},
            "saved voice": {**common, "voice": "saved"},
        }
        # every fresh prepare sends a clip of its own (seeds apart from the cached one's 7)
        fresh = [{**common, **clone, "ref_audio": data_uri(reference_wav(1000 + i))} for i in range(fresh_iterations + 5)]
        top = {part for part, _, _ in PREPARE_PARTS} | {"saved voice"}
        forms = {}
        for form in PREPARE_FORMS:
            if form == FRESH:
                warm, timed_bodies = [json.dumps(b).encode() for b in fresh[:5]], [json.dumps(b).encode() for b in fresh[5:]]
            else:
                body = json.dumps(bodies[form]).encode()
                warm, timed_bodies = [body] * max(20, iterations // 10), [body] * iterations  # cached from here on
            for body in warm:
                server.prepare(body, "")
            spent.clear()
            walls.clear()
            t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            for body in timed_bodies:
                server.prepare(body, "")
            total, wall, n = time.thread_time_ns() - t0, time.perf_counter_ns() - w0, len(timed_bodies)

            def per(ns: int, n: int = n) -> float:
                return round(ns / n / 1e3, 1)

            parts = {part: per(ns) for part, ns in spent.items() if part in top}
            parts["other"] = per(total - sum(ns for part, ns in spent.items() if part in top))
            wall_parts = {part: per(ns) for part, ns in walls.items() if part in top}
            wall_parts["other"] = per(wall - sum(ns for part, ns in walls.items() if part in top))
            forms[form] = {
                "total_us": per(total), "parts_us": parts,
                "wall_us": per(wall), "wall_parts_us": wall_parts,
                "reference_parts_us": {part: per(ns) for part, ns in spent.items() if part not in top},
                "reference_wall_parts_us": {part: per(ns) for part, ns in walls.items() if part not in top},
            }  # fmt: skip
        server.library.close()
    return {"omnistage": str(Path(omnistage.__file__).parent.parent), "iterations": iterations,
            "fresh_iterations": fresh_iterations, "forms": forms}  # fmt: skip


def worker_run(root: str, *args: str) -> dict:
    """This script with ``args`` (a worker's flags) in a process importing the tree at
    ``root``, run in ``root`` (the decoder workers, ``python -m``, import the tree of their
    directory): its JSON."""
    env = {**os.environ, "PYTHONPATH": str(Path(root).resolve())}
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=Path(root).resolve())
    return json.loads(done.stdout)


def prepare_cost(configs: list[tuple[str, str]], iterations: int, fresh_iterations: int, rounds: int) -> dict:
    """``--prepare``: each configuration's :func:`prepare_worker` in a process importing
    its tree, ``rounds`` times alternating; per form the median of the rounds' totals and
    of each part (CPU and wall)."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for _ in range(rounds):
        for name, root in configs:
            flags = ("--prepare-worker", "--iterations", str(iterations), "--fresh-iterations", str(fresh_iterations))
            runs[name].append(worker_run(root, *flags))

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    table = {}
    for name, mine in runs.items():
        table[name] = {"omnistage": mine[0]["omnistage"], "forms": {}}
        for form in PREPARE_FORMS:
            rows = [r["forms"][form] for r in mine]
            entry: dict = {"rounds_us": sorted(row["total_us"] for row in rows), "wall_rounds_us": sorted(row["wall_us"] for row in rows)}
            for key in ("total_us", "wall_us"):
                entry[key] = median([row[key] for row in rows])
            for key in ("parts_us", "wall_parts_us", "reference_parts_us", "reference_wall_parts_us"):
                entry[key] = {part: median([row[key].get(part, 0.0) for row in rows]) for part in rows[0][key]}
            table[name]["forms"][form] = entry
    return {"iterations": iterations, "fresh_iterations": fresh_iterations, "rounds": rounds, "configs": table}


def print_prepare(report: dict) -> None:
    names = list(report["configs"])
    parts = ["parse", "validate", "saved voice", "reference", "fits", "other"]
    inner = [part for part, _, _ in REFERENCE_PARTS]
    print("thread CPU us per prepare, by part")
    print(f"{'form':<15} {'config':<10} {'prepare':>9} " + " ".join(f"{p:>11}" for p in parts))
    for form in PREPARE_FORMS:
        for name in names:
            row = report["configs"][name]["forms"][form]
            cells = " ".join(f"{row['parts_us'].get(p, 0.0):>11.1f}" for p in parts)
            print(f"{form:<15} {name:<10} {row['total_us']:>9.1f} {cells}")
    print(f"\n{FRESH}: wall us per prepare, by part, and within reference")
    print(f"{'config':<10} {'prepare':>9} " + " ".join(f"{p:>9}" for p in (*parts, *inner)))
    for name in names:
        row = report["configs"][name]["forms"][FRESH]
        cells = [row["wall_parts_us"].get(p, 0.0) for p in parts] + [row["reference_wall_parts_us"].get(p, 0.0) for p in inner]
        print(f"{name:<10} {row['wall_us']:>9.1f} " + " ".join(f"{c:>9.1f}" for c in cells))


PROMPT_BATCH = 32  # the icl_batch32 mode's prompts per whole_many
REF_FRAMES = 38  # a 3 s reference clip's codes (12.5 frames per second)


def prompt_worker(iterations: int) -> dict:
    """In this process (its ``omnistage`` is the tree under test): mean thread CPU
    microseconds per talker prompt of each mode, and the aten ops one prompt dispatches
    (after the first of its kind)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import omnistage
    from omnistage.models.qwen3_tts.modeling.prompt import PromptBuilder
    from omnistage.models.qwen3_tts.modeling.weights import load_checkpoint
    from omnistage.models.qwen3_tts.random_checkpoint import write_model_files

    class Ops(TorchDispatchMode):  # its own: a tree under test need not have omnistage.testing's
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {t: load_checkpoint(write_model_files(Path(tmp) / t, "tiny", t, seed=0)) for t in ("base", "custom_voice")}
    base, custom = (PromptBuilder(ck.model.talker, ck.config, ck.tokenizer) for ck in loaded.values())
    generator = torch.Generator().manual_seed(0)
    x_vector = torch.randn(base.config.talker.decoder.hidden_size, generator=generator)
    codes = torch.randint(0, 2048, (REF_FRAMES, base.config.talker.num_code_groups), generator=generator)
    builds = {
        "icl": lambda: base.voice_clone(TEXT, x_vector, "english", REF_TEXT, codes),
        "x_vector": lambda: base.voice_clone(TEXT, x_vector, "english"),
        "custom_voice": lambda: custom.custom_voice(TEXT, "aiden", "english"),
    }
    per = dict.fromkeys(builds, 1)  # prompts per build
    if hasattr(base, "whole_many"):  # the batched preprocessing stage's builder
        def batch() -> list:
            heads = [base.voice_clone_head(x_vector, "english", REF_TEXT, codes) for _ in range(PROMPT_BATCH)]
            return base.whole_many([(head, *base.tokens.target(TEXT)) for head in heads])

        builds[f"icl_batch{PROMPT_BATCH}"] = batch
        per[f"icl_batch{PROMPT_BATCH}"] = PROMPT_BATCH
        known = base.voice_clone_head(x_vector, "english", REF_TEXT, codes)

        def batch_known_voice() -> list:  # the preprocessing stage's head cache hit
            return base.whole_many([(known, *base.tokens.target(TEXT)) for _ in range(PROMPT_BATCH)])

        builds[f"icl_batch{PROMPT_BATCH}_known_head"] = batch_known_voice
        per[f"icl_batch{PROMPT_BATCH}_known_head"] = PROMPT_BATCH
        target = base.tokens.target(TEXT)

        def batch_known_ids() -> list:  # and the text's ids made by the request builder
            return base.whole_many([(known, *target) for _ in range(PROMPT_BATCH)])

        builds[f"icl_batch{PROMPT_BATCH}_known_ids"] = batch_known_ids
        per[f"icl_batch{PROMPT_BATCH}_known_ids"] = PROMPT_BATCH
    modes = {}
    with torch.inference_mode():  # as the preprocessing stage builds them
        for mode, build in builds.items():
            rounds = max(1, iterations // per[mode])
            for _ in range(max(20, rounds // 10)):
                build()
            with Ops() as ops:
                build()
            t0 = time.thread_time_ns()
            for _ in range(rounds):
                build()
            prompts = rounds * per[mode]
            modes[mode] = {"us": round((time.thread_time_ns() - t0) / prompts / 1e3, 1), "ops": round(ops.count / per[mode], 1)}
    return {"omnistage": str(Path(omnistage.__file__).parent.parent), "iterations": iterations, "modes": modes}


def prompt_cost(configs: list[tuple[str, str]], iterations: int, rounds: int) -> dict:
    """``--prompt``: each configuration's :func:`prompt_worker` in a process importing its
    tree, ``rounds`` times alternating; per mode the median of the rounds' microseconds."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for _ in range(rounds):
        for name, root in configs:
            runs[name].append(worker_run(root, "--prompt-worker", "--iterations", str(iterations)))
    table = {}
    for name, mine in runs.items():
        modes = {}
        for mode in mine[0]["modes"]:
            times = sorted(r["modes"][mode]["us"] for r in mine)
            modes[mode] = {"us": times[len(times) // 2], "rounds_us": times, "ops": mine[0]["modes"][mode]["ops"]}
        table[name] = {"omnistage": mine[0]["omnistage"], "modes": modes}
    return {"iterations": iterations, "rounds": rounds, "configs": table}


def print_prompt(report: dict) -> None:
    print(f"{'mode':<13} {'config':<10} {'us/prompt':>10} {'aten ops':>9}")
    modes = dict.fromkeys(mode for row in report["configs"].values() for mode in row["modes"])
    for mode in modes:
        for name, row in report["configs"].items():
            if mode not in row["modes"]:
                continue  # a tree without the batched builder
            cell = row["modes"][mode]
            print(f"{mode:<13} {name:<10} {cell['us']:>10.1f} {cell['ops']:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="time SpeechServer.prepare by part per --config (no server)")
    parser.add_argument("--prepare-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", action="store_true", help="time PromptBuilder's prompts by mode per --config (no server)")
    parser.add_argument("--prompt-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", nargs=2, action="append", metavar=("NAME", "ROOT"), help="--prepare, --prompt: a source tree")
    parser.add_argument("--iterations", type=int, default=2000, help="--prepare, --prompt: timed per form or mode and round")
    parser.add_argument("--fresh-iterations", type=int, default=40, help="--prepare: fresh-reference prepares per round")
    parser.add_argument("--rounds", type=int, default=3, help="--prepare, --prompt: rounds, alternating the configurations")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra omnistage serve argument (repeatable)")
    args = parser.parse_args()
    if args.prepare_worker:
        print(json.dumps(prepare_worker(args.iterations, args.fresh_iterations)))
        return
    if args.prompt_worker:
        print(json.dumps(prompt_worker(args.iterations)))
        return
    if args.prompt:
        report = prompt_cost([tuple(c) for c in args.config or [("this", ".")]], args.iterations, args.rounds)
        print_prompt(report)
        if args.output:
            args.output.write_text(json.dumps(report, indent=2))
        return
    if args.prepare:
        report = prepare_cost([tuple(c) for c in args.config or [("this", ".")]], args.iterations, args.fresh_iterations, args.rounds)
        print_prepare(report)
        if args.output:
            args.output.write_text(json.dumps(report, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, ref = tiny_base_checkpoint(work)
        proc = serve(model_dir, args.port, args.concurrency, work / "server.log", args.serve_arg)
        try:
            bench(args.port, args.concurrency, args.concurrency, args.frames, ref, work / "warm.json", warmup=2)
            pids = server_pids(proc.pid)
            names = {pid: thread_names(pid) for pid in pids}
            before = {pid: thread_cpu_s(pid) for pid in pids}
            t0 = time.perf_counter()
            level = bench(args.port, args.concurrency, args.requests, args.frames, ref, work / "level.json", warmup=0)
            wall = time.perf_counter() - t0
            after = {pid: thread_cpu_s(pid) for pid in pids}
        finally:
            proc.terminate()
            proc.wait(30)
    ok = level["num_ok"]
    groups: dict[str, float] = {}
    for pid, threads in after.items():
        for tid, cpu in threads.items():
            group = group_of(names[pid].get(tid), pid != proc.pid)
            groups[group] = groups.get(group, 0.0) + cpu - before[pid].get(tid, 0.0)
    per_request = {g: round(1e3 * s / ok, 2) for g, s in sorted(groups.items(), key=lambda kv: -kv[1])}
    report = {
        "concurrency": args.concurrency, "requests_ok": ok, "frames": args.frames, "wall_s": round(wall, 1),
        "cpu_ms_per_request": per_request, "cpu_ms_per_request_total": round(sum(per_request.values()), 2),
        "ttfa_ms": level["ttfa_ms"], "audio_throughput": level["audio_throughput"],
        "ttfa_phases_ms": level.get("ttfa_phases_ms"), "serve_args": args.serve_arg,
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
