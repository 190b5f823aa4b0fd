"""Qwen3-Omni served by omnistage: streamed chat with audio over ``POST /v1/chat/completions``.

Drives a server (``--base-url``, or one this script starts from ``--model-dir`` with
``omnistage serve`` and ``--server-arg`` values; the default serves random weights drawn from config.json,
``--load-format dummy``, with the engines sized for the largest level) with
OpenAI's chat-completions shape: ``stream: true``, ``modalities: ["text", "audio"]``,
``audio: {"voice", "format": "pcm16"}`` (24 kHz 16-bit mono), ``stream_options:
{"include_usage": true}``; text arrives as ``choices[0].delta.content`` (or
``delta.audio.transcript``), audio as base64 ``delta.audio.data``. Three prompts: a short text
question, an image (a random 640x480 PNG as a data URI) + text, an audio clip (3 s of
16 kHz WAV as ``input_audio``) + text. Closed loop: at each ``--concurrency`` level,
``concurrency x --rounds`` requests with ``concurrency`` in flight.

Per request: TTFT (first text), TTFA (first audio bytes), end; per level: their p50/p90/p99,
RTF per stream (wall time from the request to its last audio byte over the audio's
duration), text tokens/s per stream (``usage.completion_tokens`` over the time from the first
to the last text), aggregate audio seconds per wall second, failures, GPU memory used
(``nvidia-smi``, sampled at the end of each level).

``--reference`` (after the server is stopped, which needs ``--model-dir``): transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` at batch 1 on the same config for the text
prompt, greedy, ``--max-tokens`` thinker tokens: its whole time (it returns the audio at the
end, so that is its TTFA) against ours. Its weights are transformers' own random init, not
the ones the server drew: transformers 5 renames and fuses the checkpoint's expert tensors
while loading, so ours cannot be copied in by name, and the 65.7 GB checkpoint does not fit
the GPU machine's disk. A step's speed does not depend on the values; the lengths are set
by the limits (a random talker may still stop early: its audio seconds are recorded).

Prints a table and writes ``OUT_DIR/qwen3_omni_served.json``::

    python benchmarks/qwen3_omni_served.py --out-dir $OUT --model-dir DIR --reference
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import soundfile
from PIL import Image

from omnistage.bench.speed import Distribution

PCM16_RATE = 24000
TEXT_PROMPT = "What is the capital of France? Answer in one sentence."


def image_part(seed: int) -> dict:
    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": uri}}


def audio_part(seed: int, seconds: float = 3.0) -> dict:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.02 * rng.standard_normal(t.shape)
    buffer = io.BytesIO()
    soundfile.write(buffer, wave.astype(np.float32), 16000, format="WAV")
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(), "format": "wav"},
    }


def prompt_content(kind: str) -> list[dict]:
    if kind == "text":
        return [{"type": "text", "text": TEXT_PROMPT}]
    if kind == "image+text":
        return [image_part(0), {"type": "text", "text": "Describe this image in one sentence."}]
    return [audio_part(0), {"type": "text", "text": "What do you hear? Answer in one sentence."}]


@dataclass
class ChatResult:
    ok: bool
    error: str | None = None
    ttft_ms: float | None = None
    ttfa_ms: float | None = None
    total_ms: float | None = None
    last_audio_ms: float | None = None
    last_text_ms: float | None = None
    audio_s: float = 0.0
    completion_tokens: int | None = None


async def chat(client: httpx.AsyncClient, body: dict) -> ChatResult:
    """One streamed chat request; times are from sending it."""
    start = time.perf_counter()
    result = ChatResult(ok=False)
    pcm_bytes = 0
    completed = False  # the stream's [DONE]: a failed request's stream ends without it

    def now_ms() -> float:
        return (time.perf_counter() - start) * 1e3

    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    completed = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):  # the request failed; no [DONE] follows
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    audio = delta.get("audio") or {}
                    if delta.get("content") or audio.get("transcript"):
                        result.last_text_ms = now_ms()
                        if result.ttft_ms is None:
                            result.ttft_ms = result.last_text_ms
                    if audio.get("data"):
                        pcm_bytes += len(base64.b64decode(audio["data"]))
                        result.last_audio_ms = now_ms()
                        if result.ttfa_ms is None:
                            result.ttfa_ms = result.last_audio_ms
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.total_ms = now_ms()
    result.audio_s = pcm_bytes / 2 / PCM16_RATE
    result.ok = completed and result.ttfa_ms is not None
    if not completed:
        result.error = result.error or "the stream ended without [DONE] (the request failed)"
    elif result.ttfa_ms is None:
        result.error = "no audio in the stream"
    return result


def request_body(kind: str, voice: str, max_tokens: int, model: str | None) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt_content(kind)}],
        "modalities": ["text", "audio"], "audio": {"voice": voice, "format": "pcm16"},
        "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
        "temperature": 0.0,
    }  # fmt: skip
    if model is not None:
        body["model"] = model
    return body


def gpu_memory_mib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return float(out.stdout.split()[0])


def dist(values: list[float]) -> dict:
    d = Distribution.of(values)
    return {k: None if v is None else round(v, 2) for k, v in asdict(d).items()}


async def run_level(
    base_url: str, body: dict, concurrency: int, rounds: int, timeout_s: float
) -> dict:
    total = concurrency * rounds
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    results: list[ChatResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                results.append(await chat(client, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    rtf = [r.last_audio_ms / 1e3 / r.audio_s for r in ok if r.audio_s > 0 and r.last_audio_ms]
    tps = [
        r.completion_tokens / ((r.last_text_ms - r.ttft_ms) / 1e3)
        for r in ok
        if r.completion_tokens
        and r.ttft_ms is not None
        and r.last_text_ms
        and r.last_text_ms > r.ttft_ms
    ]
    return {
        "concurrency": concurrency, "requests": total, "failed": total - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "ttft_ms": dist([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "ttfa_ms": dist([r.ttfa_ms for r in ok]), "rtf": dist(rtf), "rtf_max": round(max(rtf), 3) if rtf else None,
        "tokens_per_s_per_stream": dist(tps),
        "tokens_per_s": round(sum(r.completion_tokens or 0 for r in ok) / wall, 1),
        "audio_s_per_s": round(sum(r.audio_s for r in ok) / wall, 2), "wall_s": round(wall, 2),
        "gpu_memory_mib": gpu_memory_mib(),
    }  # fmt: skip


def start_server(model_dir: Path, port: int, server_args: list[str], log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "omnistage.cli",
        "serve",
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        *server_args,
    ]
    print(" ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"the server did not become healthy in 900 s; see {log}")


def default_server_args(max_num_seqs: int) -> list[str]:
    """Random weights drawn from config.json (``--load-format dummy``), and engines, vocoder
    slots and KV pools sized for ``max_num_seqs`` concurrent streams."""
    args = ["--load-format", "dummy", "--max-concurrent-requests", str(4 * max_num_seqs)]
    for stage, kv in (("thinker", 16 << 30), ("talker", 4 << 30)):
        args += [
            f"--{stage}.factory.args.max_num_seqs",
            str(max_num_seqs),
            f"--{stage}.factory.args.kv_cache_bytes",
            str(kv),
        ]
    return [*args, "--code2wav.factory.args.num_slots", str(max_num_seqs)]


def reference_generate(model_dir: Path, max_tokens: int, frames: int, voice: str) -> dict:
    """transformers' generate at batch 1, greedy, on its own random init of the same config
    (module docstring)."""
    import torch
    from transformers import AutoConfig, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.qwen3_omni.processing import Qwen3OmniProcessor

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    torch.set_grad_enabled(False)
    raw = json.loads((model_dir / "config.json").read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    with device:
        ref = Qwen3OmniMoeForConditionalGeneration._from_config(
            AutoConfig.from_pretrained(str(model_dir)), dtype=dtype
        )
    ref.eval()
    load_s = time.perf_counter() - start
    # the chat turn by the config's ids (a test tokenizer has no role words at their real ids)
    tokenizer = Qwen3OmniProcessor.from_checkpoint(model_dir).tokenizer
    nl = tokenizer.encode("\n")
    start_id, end_id = raw["im_start_token_id"], raw["im_end_token_id"]
    turn = [start_id, raw["user_token_id"], *nl, *tokenizer.encode(TEXT_PROMPT), end_id, *nl]
    ids = torch.tensor([turn + [start_id, raw["assistant_token_id"], *nl]], device=device)
    timings = []
    for _ in range(2):  # the first call warms up
        sync()
        t0 = time.perf_counter()
        text_ids, audio = ref.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), speaker=voice, thinker_max_new_tokens=max_tokens,
            thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=frames,
        )  # fmt: skip
        sync()
        timings.append(time.perf_counter() - t0)
    tokens = int(text_ids.shape[-1] - ids.shape[-1])
    audio_s = 0.0 if audio is None else float(audio.numel()) / PCM16_RATE
    return {"init_s": round(load_s, 1), "total_s": round(timings[-1], 3),
            "thinker_tokens": tokens, "audio_s": round(audio_s, 2),
            "rtf": round(timings[-1] / audio_s, 3) if audio_s else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--base-url", help="a running server (else --model-dir starts one)")
    parser.add_argument(
        "--model-dir", type=Path, help="checkpoint (config.json + tokenizer) to serve"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--server-arg", action="append", default=None,
                        help="one argument for omnistage serve (repeat); default: load_format dummy everywhere, "
                             "engines sized for the largest concurrency")  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompts", nargs="+", choices=["text", "image+text", "audio+text"],
                        default=["text", "image+text", "audio+text"])  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=2, help="requests per level = concurrency x rounds"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--voice", default="ethan")
    parser.add_argument("--model", default=None, help="the request's model field (default: none)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--reference", action="store_true", help="transformers' generate at batch 1 afterwards"
    )
    parser.add_argument("--reference-frames", type=int, default=100)
    args = parser.parse_args()
    if (args.base_url is None) == (args.model_dir is None):
        parser.error("give exactly one of --base-url and --model-dir")
    if args.reference and args.model_dir is None:
        parser.error("--reference needs --model-dir (the server must be stopped to free the GPU)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "qwen3_omni_served.json"
    result: dict = {"levels": [], "args": {k: str(v) for k, v in vars(args).items()}}
    proc = None
    base_url = args.base_url
    if args.model_dir is not None:
        server_args = (
            args.server_arg
            if args.server_arg is not None
            else default_server_args(max(args.concurrency))
        )
        start = time.perf_counter()
        proc = start_server(args.model_dir, args.port, server_args, args.out_dir / "server.log")
        result["server_start_s"] = round(time.perf_counter() - start, 1)
        base_url = f"http://127.0.0.1:{args.port}"
    try:
        asyncio.run(
            run_level(
                base_url, request_body("text", args.voice, 8, args.model), 1, 1, args.timeout_s
            )
        )  # warm-up
        for kind in args.prompts:
            body = request_body(kind, args.voice, args.max_tokens, args.model)
            for concurrency in args.concurrency:
                level = {
                    "prompt": kind,
                    **asyncio.run(
                        run_level(base_url, body, concurrency, args.rounds, args.timeout_s)
                    ),
                }
                result["levels"].append(level)
                print(json.dumps(level), flush=True)
                out.write_text(json.dumps(result, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    if args.reference:
        result["reference"] = reference_generate(
            args.model_dir, args.max_tokens, args.reference_frames, args.voice
        )
        first = next(
            (lv for lv in result["levels"] if lv["prompt"] == "text" and lv["concurrency"] == 1),
            None,
        )
        if first is not None and first["ttfa_ms"]["p50"] is not None:
            result["reference"]["ttfa_ratio_ours_over_reference"] = round(
                first["ttfa_ms"]["p50"] / 1e3 / result["reference"]["total_s"], 4
            )
        print("reference", json.dumps(result["reference"]), flush=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{'prompt':11} {'conc':>4} {'fail':>4} {'TTFT p50':>9} {'TTFA p50':>9} {'TTFA p99':>9} "
          f"{'RTF max':>8} {'tok/s':>7} {'audio s/s':>9} {'GPU MiB':>8}")  # fmt: skip
    for lv in result["levels"]:
        print(f"{lv['prompt']:11} {lv['concurrency']:>4} {lv['failed']:>4} {lv['ttft_ms']['p50']!s:>9} "
              f"{lv['ttfa_ms']['p50']!s:>9} {lv['ttfa_ms']['p99']!s:>9} {lv['rtf_max']!s:>8} "
              f"{lv['tokens_per_s']:>7} {lv['audio_s_per_s']:>9} {lv['gpu_memory_mib']!s:>8}")  # fmt: skip


if __name__ == "__main__":
    main()
