"""Soak run: mixed requests against the Piper voice and a tiny Qwen3-TTS Base, with
random client aborts and injected faults in every stage (issue 12), then pass criteria.

Two real servers (uvicorn, in this process, on free loopback ports): the bundled Piper
voice, and a tiny random Qwen3-TTS Base checkpoint with its ``tts_engine`` stage in its
own process (so that ``kill`` faults exercise the restart path). Requests: Piper and
Qwen3-TTS (voice clone from a reference clip, ICL or x-vector), whole-file WAV, raw PCM
stream or SSE, a few deliberately invalid ones; ``--abort-rate`` of them are cut by the
client after a random delay. Faults (``OMNISTAGE_FAULTS``, see
``omnistage/scheduling/faults.py``): raise, CUDA OOM (simulated), a hang past the request
deadline, and kills of the engine process.

Pass criteria (the JSON report's ``criteria``; exit status 1 if one fails):
- ``no_hang``: every request ended within its deadline plus a margin (client side);
- ``no_unexplained_outcome``: every outcome is one of: complete success; 400 for the
  invalid ones; an injected failure surfaced as a 500 (or SSE error event, or a raw
  stream cut without its clean end) that names the stage the fault was injected at and
  the request id, under which the coordinator's log holds the injected cause (the body
  itself never carries it); 504 past the deadline; 503 while a
  killed stage process restarts, or at the admission bound (a client that just aborted a
  request sends the next before the server has ended the first); our own client aborts;
- ``no_leaked_state``: afterwards no request state in any stage, process, relay, shared
  memory segment or coordinator of either server, and no decode job in flight;
- ``rss_within_10pct``: RSS of this process and its children at the end is within 10 % of
  its value after the warm-up requests;
- ``healthy_at_end``: both servers answer ``/health`` 200 at the end;
- ``faults_injected``: faults did fire (the run tested something).

Usage (repository root, the project's venv):
    python benchmarks/soak.py --requests 10000 --concurrency 64 \\
        --output benchmarks/results/soak_10k.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import soundfile
import uvicorn

from omnistage.scheduling.faults import FAULTS_ENV, parse_faults

ROOT = Path(__file__).resolve().parents[1]
SHORT_TEXTS = (
    "Hello there.",
    "Yes.",
    "Watch out!",
    "It is nine.",
    "Good morning, Sam.",
    "Call me back.",
)
REF_TEXT = "A short reference clip."
QWEN_FRAMES = (2, 3, 4, 6)


def default_faults(timeout_s: float) -> str:
    """Faults in every stage of both pipelines; probabilities are per batch (the engine
    and the vocoder run one batch per decode step, so theirs are lower)."""
    hang = f"hang={timeout_s + 1:g}"
    return ",".join(
        [
            "preprocessing:raise~0.01",  # both models have a stage of this name
            "reference_encoder:raise~0.01",
            "synthesis:raise~0.01",
            "synthesis:oom~0.005",
            f"synthesis:{hang}@40",
            "tts_engine:oom~0.002",
            "tts_engine:raise~0.001",
            "tts_engine:kill@400",  # per life of the engine process
            "vocoder:raise~0.002",
        ]
    )


@dataclass
class Server:
    name: str
    base_url: str
    app: object
    uvicorn: uvicorn.Server
    thread: threading.Thread

    @property
    def pipeline(self):
        return self.app.state.server.pipeline


def start_server(name: str, config) -> Server:
    from omnistage.serve.app import ServerSettings, create_app
    from omnistage.serve.media import MediaPolicy

    fatal: list[str] = []
    app = create_app(
        config, ServerSettings(playground=False, media_policy=MediaPolicy()), on_fatal=fatal.append
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = Server(name, f"http://127.0.0.1:{port}", app, server, thread)
    wait_healthy(running, 300)
    return running


def wait_healthy(server: Server, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def reference_clip() -> str:
    rate = 16_000
    t = np.arange(int(1.2 * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 150 * t) + 0.1 * np.sin(2 * np.pi * 450 * t)
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def pick_request(rng: random.Random, ref_audio: str) -> tuple[str, dict, str, bool]:
    """(server name, body, mode, expect_400)."""
    mode = rng.choice(["wav", "pcm_stream", "sse"])
    fields = {"wav": {"response_format": "wav"},
              "pcm_stream": {"response_format": "pcm", "stream": True},
              "sse": {"stream_format": "sse"}}[mode]  # fmt: skip
    if rng.random() < 0.03:  # an invalid request: refused before any model work
        return (
            "qwen3_tts",
            {"input": "Hi.", "ref_audio": "data:audio/wav;base64,AAAA", "x_vector_only_mode": True},
            "wav",
            True,
        )
    if rng.random() < 0.5:
        return "piper", {"input": rng.choice(SHORT_TEXTS), **fields}, mode, False
    body = {"input": rng.choice(SHORT_TEXTS), "ref_audio": ref_audio, "max_new_tokens": rng.choice(QWEN_FRAMES),
            "seed": rng.randrange(1 << 16), **fields}  # fmt: skip
    if rng.random() < 0.5:
        body["ref_text"] = REF_TEXT
    else:
        body["x_vector_only_mode"] = True
    return "qwen3_tts", body, mode, False


STAGE_FAILURE = re.compile(r"stage '(?P<stage>[\w.-]+)' failed for request (?P<request_id>\S+);")
COORDINATOR_LOG = re.compile(r"request (?P<request_id>\S+): (?P<cause>.*)", re.DOTALL)


class FailureLog(logging.Handler):
    """The coordinator's log lines by request id: where a stage failure's cause goes (a
    client's 500 body names only the stage and the request id)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.causes: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if match := COORDINATOR_LOG.fullmatch(record.getMessage()):
            self.causes[match["request_id"]] = match["cause"]


@dataclass
class Classifier:
    """Names an outcome from what the server exposes: the status, the error body's type
    and message (a stage failure names its stage and request id), and the coordinator's
    log line under that id (the cause). A failure is explained when its cause is a fault
    injected at the stage its body names; a body that carries the cause is not."""

    log: FailureLog
    fault_stages: frozenset[str]

    def __call__(self, status: int, text: str, mode: str, expect_400: bool) -> str:
        if expect_400:
            return "rejected_400" if status == 400 else f"unexpected_{status}"
        if status == 200:
            if mode != "sse" or '"speech.audio.done"' in text:
                return "ok"
            event = next((line[6:] for line in text.splitlines() if line.startswith("data: ") and '"type":"error"' in line), None)
            if event is None:
                return "unexpected_sse_without_error_event"
            error = json.loads(event)["error"]
            return "sse_error_surfaced" if self.explained(error) else f"unexpected_sse_{error['type']}"
        try:
            error = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return f"unexpected_{status}_body"
        if status == 500:
            return "failed_500_surfaced" if self.explained(error) else f"unexpected_500_{error['type']}"
        if status == 504 and error["type"] == "timeout":
            return "timeout_504"
        if status == 503 and error["type"] == "queue_full":
            return "queue_full_503"  # admission bound: an aborted request still ending
        if status == 503 and error["type"] == "service_unavailable" and "stage process" in error["message"]:
            return "unavailable_503"  # a killed stage process restarts
        return f"unexpected_{status}_{error['type']}:{error['message'][:80]}"

    def explained(self, error: dict) -> bool:
        """Whether a failed request's error body (an SSE error event's too) is one the run
        caused: a deadline, a stage process that was killed, or a stage failure whose logged
        cause is an injected fault, told without that cause."""
        if error["type"] == "timeout":
            return True
        if error["type"] == "service_unavailable":
            return "stage process" in error["message"]
        match = STAGE_FAILURE.match(error["message"])
        if error["type"] != "stage_failure" or match is None or match["stage"] not in self.fault_stages:
            return False
        cause = self.log.causes.get(match["request_id"], "")
        return "injected" in cause and cause not in error["message"] and "injected" not in error["message"]


async def one_request(client: httpx.AsyncClient, servers: dict[str, Server], classify: Classifier, job,
                      abort_after: float | None, limit_s: float) -> str:  # fmt: skip
    name, body, mode, expect_400 = job
    url = f"{servers[name].base_url}/v1/audio/speech"

    async def run() -> str:
        async with client.stream("POST", url, json=body) as response:
            chunks = [chunk async for chunk in response.aiter_bytes()]
            return classify(
                response.status_code, b"".join(chunks).decode("latin-1"), mode, expect_400
            )

    task = asyncio.ensure_future(run())
    try:
        if abort_after is not None:
            done, _ = await asyncio.wait({task}, timeout=abort_after)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return "client_abort"
        return await asyncio.wait_for(task, limit_s)
    except TimeoutError:
        return "hang"
    except httpx.RemoteProtocolError:
        return "stream_cut_surfaced"  # raw stream ended without its clean end
    except httpx.HTTPError as exc:
        return f"unexpected_transport:{type(exc).__name__}"


def tree_rss_mib() -> dict[str, float]:
    """RSS in MiB of this process and of each of its descendants (stage processes,
    decoder workers), by ``<pid> <program>``."""
    rss, pending = {}, [os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/status") as status:
                kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                program = (
                    cmdline.read().split(b"\0")[-2 if pid != os.getpid() else 1].decode()[-40:]
                )
            rss[f"{pid} {program}"] = round(kib / 1024, 1)
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    pending += [int(c) for c in children.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration, IndexError):
            continue  # exited meanwhile
    return rss


async def drive(
    servers: dict[str, Server], classify: Classifier, args, ref_audio: str, start: int, count: int
) -> Counter:
    rng = random.Random(args.seed * 7919 + start)
    outcomes: Counter = Counter()
    gate = asyncio.Semaphore(args.concurrency)
    limit_s = args.timeout_s + 30.0
    limits = httpx.Limits(
        max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(limit_s), limits=limits, trust_env=False
    ) as client:

        async def guarded(job, abort_after) -> None:
            async with gate:
                outcomes[await one_request(client, servers, classify, job, abort_after, limit_s)] += 1

        jobs = []
        for _ in range(count):
            job = pick_request(rng, ref_audio)
            abort_after = rng.uniform(0.0, 0.5) if rng.random() < args.abort_rate else None
            jobs.append(guarded(job, abort_after))
        await asyncio.gather(*jobs)
    return outcomes


async def leak_report(server: Server) -> dict:
    from omnistage.serve.decoding import shared_pool

    pipeline = server.pipeline
    loop = pipeline.coordinator.loop
    deadline = time.monotonic() + 30
    state: dict = {}
    while time.monotonic() < deadline:
        future = asyncio.run_coroutine_threadsafe(pipeline.live_state(), loop)
        state = await asyncio.wrap_future(future)
        if not state and shared_pool().jobs_in_flight == 0:
            return {}
        await asyncio.sleep(0.2)
    return {**state, "decode_jobs_in_flight": shared_pool().jobs_in_flight}


def build_configs(timeout_s: float, tmp: Path):
    from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
    from omnistage.models.qwen3_tts.random_checkpoint import write_random_checkpoint
    from omnistage.serve.registry import ModelRegistry

    common = {
        "request_timeout_s": timeout_s,
        "max_stage_restarts": 1000,
        "stage_restart_backoff_s": 0.2,
    }
    piper = ModelRegistry.discover().resolve(None).model_copy(update=common)
    checkpoint = write_random_checkpoint(tmp / "qwen3_tts_base", "tiny", "base", seed=0)
    qwen = Qwen3TTSPipelineConfig.for_model_path(str(checkpoint)).model_copy(update=common)
    qwen.stage("tts_engine").process = "engine"
    qwen.stage("tts_engine").factory.args["kv_cache_bytes"] = 64 << 20  # not 1/8 of the RAM
    return piper, qwen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=300, help="requests before the RSS baseline")
    parser.add_argument("--abort-rate", type=float, default=0.1)
    parser.add_argument(
        "--timeout-s", type=float, default=20.0, help="request deadline (request_timeout_s)"
    )
    parser.add_argument(
        "--faults", default=None, help=f"{FAULTS_ENV} value (default: a mix in every stage)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.ERROR, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ[FAULTS_ENV] = (
        args.faults if args.faults is not None else default_faults(args.timeout_s)
    )
    os.environ["OMNISTAGE_FAULTS_SEED"] = str(args.seed)
    injected: Counter = Counter()

    class CountFaults(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            injected[record.getMessage().split("injected fault ")[1].split(" ")[0]] += 1

    faults_logger = logging.getLogger("omnistage.scheduling.faults")
    faults_logger.addHandler(CountFaults())
    faults_logger.setLevel(logging.WARNING)
    failures = FailureLog()
    logging.getLogger("omnistage.pipeline.coordinator").addHandler(failures)
    classify = Classifier(failures, frozenset(f.stage for f in parse_faults(os.environ[FAULTS_ENV])))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omnistage-soak-") as tmp:
        piper, qwen = build_configs(args.timeout_s, Path(tmp))
        servers = {
            "piper": start_server("piper", piper),
            "qwen3_tts": start_server("qwen3_tts", qwen),
        }
        setup_s = time.perf_counter() - started
        ref_audio = reference_clip()
        outcomes = asyncio.run(drive(servers, classify, args, ref_audio, 0, args.warmup))
        rss_warm_by_process = tree_rss_mib()
        rss_warm = sum(rss_warm_by_process.values())
        run_started = time.perf_counter()
        outcomes += asyncio.run(
            drive(servers, classify, args, ref_audio, args.warmup, args.requests - args.warmup)
        )
        run_s = time.perf_counter() - run_started
        healthy = {name: wait_healthy(s, 120) for name, s in servers.items()}
        leaks = {name: asyncio.run(leak_report(s)) for name, s in servers.items()}
        rss_end_by_process = tree_rss_mib()
        rss_end = sum(rss_end_by_process.values())
        restarts = {
            name: {g: len(r) for g, r in s.pipeline._restarts.items()}
            for name, s in servers.items()
        }
        for server in servers.values():
            server.uvicorn.should_exit = True
            server.thread.join(30)
    unexplained = {
        k: v
        for k, v in outcomes.items()
        if k.startswith(("unexpected", "hang"))
    }
    criteria = {
        "no_hang": outcomes["hang"] == 0,
        "no_unexplained_outcome": not unexplained,
        "no_leaked_state": not any(leaks.values()),
        "rss_within_10pct": rss_end <= 1.10 * rss_warm,
        "healthy_at_end": all(healthy.values()),
        "faults_injected": sum(injected.values()) + sum(sum(r.values()) for r in restarts.values())
        > 0,
    }
    report = {
        "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "passed": all(criteria.values()),
        "criteria": criteria,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "abort_rate": args.abort_rate,
        "timeout_s": args.timeout_s,
        "faults": os.environ[FAULTS_ENV],
        "outcomes": dict(sorted(outcomes.items())),
        "unexplained": unexplained,
        "faults_fired_in_server_process": dict(injected),
        "stage_process_restarts": restarts,
        "leaks": leaks,
        "rss_mib_after_warmup": round(rss_warm, 1),
        "rss_mib_at_end": round(rss_end, 1),
        "rss_mib_by_process_after_warmup": rss_warm_by_process,
        "rss_mib_by_process_at_end": rss_end_by_process,
        "healthy_at_end": healthy,
        "setup_s": round(setup_s, 1),
        "run_s": round(run_s, 1),
        "requests_per_s": round((args.requests - args.warmup) / run_s, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
