"""Resident memory of the Piper voice under a constant workload, for each setting of
onnxruntime's CPU memory arena (grow: its default; shrink: shrunk after every run; off)
(issue 12: RSS crept from 2,135 to 2,330 MiB over 1,400 requests).

Each variant runs in a fresh process: the bundled voice's pipeline (no HTTP), the
built-in benchmark sentences in a fixed shuffled order, ``--concurrency`` requests at a
time (so batches of varied shapes), RSS sampled after the warm-up and every
``--every`` requests.

Usage (repository root, the project's venv):
    python benchmarks/piper_memory.py --requests 300 --output benchmarks/results/piper_memory.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def run_variant(arena: str, requests: int, concurrency: int, every: int) -> dict:
    from omnistage.bench.sentences import BUILTIN_SENTENCES
    from omnistage.pipeline.pipeline import Pipeline
    from omnistage.serve.media import MediaPolicy
    from omnistage.serve.protocol import SpeechRequest
    from omnistage.serve.registry import ModelRegistry

    config = ModelRegistry.discover().resolve(None)
    config.stage("synthesis").factory.args["memory_arena"] = arena
    texts = list(BUILTIN_SENTENCES)
    random.Random(0).shuffle(texts)
    samples: list[tuple[int, float]] = []
    async with Pipeline(config) as pipeline:

        async def one(i: int) -> None:
            request = config.build_request(
                SpeechRequest(input=texts[i % len(texts)]), MediaPolicy()
            )
            await pipeline.submit(request, collect=True).result()

        for i in range(len(texts)):  # warm-up: every sentence once
            await one(i)
        samples.append((0, rss_mib()))
        started = time.perf_counter()
        for start in range(0, requests, concurrency):
            await asyncio.gather(
                *(one(i) for i in range(start, min(start + concurrency, requests)))
            )
            done = min(start + concurrency, requests)
            if done % every == 0 or done == requests:
                samples.append((done, rss_mib()))
        wall = time.perf_counter() - started
    warm, end = samples[0][1], samples[-1][1]
    return {
        "memory_arena": arena,
        "requests": requests,
        "concurrency": concurrency,
        "rss_mib_after_warmup": round(warm, 1),
        "rss_mib_at_end": round(end, 1),
        "growth_mib": round(end - warm, 1),
        "peak_mib": round(max(r for _, r in samples), 1),
        "requests_per_s": round(requests / wall, 2),
        "rss_mib_by_request": [[n, round(r, 1)] for n, r in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--variant", choices=["grow", "shrink", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.variant:
        result = asyncio.run(run_variant(args.variant, args.requests, args.concurrency, args.every))
        print(json.dumps(result))
        return
    results = []
    for variant in ("grow", "shrink", "off"):
        command = [sys.executable, __file__, "--variant", variant, "--requests", str(args.requests),
                   "--concurrency", str(args.concurrency), "--every", str(args.every)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{variant:9} RSS after warm-up {r['rss_mib_after_warmup']} MiB, at end {r['rss_mib_at_end']} "
              f"MiB (+{r['growth_mib']}), {r['requests_per_s']} req/s", file=sys.stderr)  # fmt: skip
    report = {
        "command": " ".join(["python", "benchmarks/piper_memory.py", *sys.argv[1:]]),
        "variants": results,
    }
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
