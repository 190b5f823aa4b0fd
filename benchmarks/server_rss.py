"""Resident memory of a served model, for source trees side by side (issue 13: memory that
follows the model, not the host).

For each ``--config NAME ROOT`` (a source tree: ``git archive REV | tar -x -C ROOT``), one
after another: ``python -m omnistage.cli serve`` with ``PYTHONPATH=ROOT`` (the embedded
default voice, or ``--model-path``), wait for ``/health`` 200, read the RSS summed over the
server's process tree (VmRSS of every process, in MiB), send ``--requests`` speech requests
one at a time (pcm; with ``--ref-audio``-less Base checkpoints pass ``--clone`` for a 1 s
tone reference), read it again, stop the server. Prints a table and writes JSON.

Usage (repository root, the project's venv):
    git archive acda2d9 | tar -x -C /tmp/before
    python benchmarks/server_rss.py --config before /tmp/before --config after . \\
        --output benchmarks/results/server_rss_default_voice.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from omnistage.testing.waits import free_port, wait_until


def tree_rss_mib(root: int) -> dict[int, float]:
    """VmRSS (MiB) of ``root`` and each live descendant, by pid (``/proc``)."""
    rss, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        kib = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
        )
        rss[pid] = kib / 1024
        todo += [int(c) for c in children]
    return rss


def tone_reference() -> str:
    """A 1 s 220 Hz tone at 24 kHz as a WAV data URI (a voice-clone reference)."""
    buf = io.BytesIO()
    t = np.arange(24000) / 24000
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 24000, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def measure(name: str, root: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "omnistage.cli",
        "serve",
        "--port",
        str(port),
        "--no-playground",
        "--log-level",
        "warning",
    ]
    if args.model_path:
        cmd += ["--model-path", str(args.model_path)]
    env = {**os.environ, "PYTHONPATH": str(root.resolve())}
    server = subprocess.Popen(
        cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if server.poll() is not None:
            raise RuntimeError(f"{name}: the server exited with {server.returncode}")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, args.start_timeout_s, f"{name}: /health 200")
        ready = tree_rss_mib(server.pid)
        body: dict = {"response_format": "pcm"}
        if args.clone:
            body |= {"ref_audio": tone_reference(), "ref_text": "Hello.", "max_new_tokens": 16}
        for i in range(args.requests):
            r = httpx.post(
                f"{url}/v1/audio/speech",
                json={**body, "input": f"Hello there, number {i}."},
                timeout=300,
            )
            r.raise_for_status()
        after = tree_rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    return {
        "config": name, "root": str(root),
        "ready_mib": round(sum(ready.values()), 1), "after_mib": round(sum(after.values()), 1),
        "processes_after_mib": sorted((round(v, 1) for v in after.values()), reverse=True),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", nargs=2, action="append", metavar=("NAME", "ROOT"), required=True
    )
    parser.add_argument(
        "--model-path", type=Path, help="a checkpoint (default: the embedded default voice)"
    )
    parser.add_argument(
        "--clone", action="store_true", help="voice-clone requests (a Base checkpoint)"
    )
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows = [measure(name, Path(root), args) for name, root in args.config]
    base = rows[0]
    print(f"{'config':<12} {'ready MiB':>10} {'after MiB':>10} {'ratio after':>12}")
    for row in rows:
        print(
            f"{row['config']:<12} {row['ready_mib']:>10.1f} {row['after_mib']:>10.1f} {row['after_mib'] / base['after_mib']:>12.3f}"
        )
    if args.output:
        meta = {
            "command": " ".join(sys.argv),
            "model_path": str(args.model_path or "default voice"),
            "requests": args.requests,
        }
        args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
