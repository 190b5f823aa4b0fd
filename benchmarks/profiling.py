"""Profiling helpers of the device benchmarks (``qwen3_tts_gpu.py``, ``qwen3_omni_served.py``,
``gpu_share.py``): a py-spy profile of a served process tree during one level, the server's
own TTFA decomposition read from its ``/metrics`` (``omnistage_request_phase_seconds``, see
:mod:`omnistage.pipeline.timeline`), and the CUDA kernels of a callable by device time."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.profiler import ProfilerActivity, profile


class PySpyProfile:
    """``py-spy record`` of the server's process tree during one level (``--py-spy BIN``):
    after ``delay_s`` it samples every thread that is running (not waiting) at 100 Hz for
    ``duration_s``, without pausing the process (``--nonblocking``), into collapsed stacks
    (``--format raw``: one ``frame;frame;... count`` line per distinct stack, the thread
    first). With ``gil`` only the thread holding the GIL is sampled (``--gil``), so the
    shares say who holds it. ``stop()`` waits for it and returns where the samples went
    (:func:`stack_summary`)."""

    def __init__(self, binary: str, pid: int, out: Path, delay_s: float, duration_s: float, gil: bool = False) -> None:
        self.out, self.proc = out, None
        cmd = [
            binary, "record", "--pid", str(pid), "--rate", "100", "--duration", str(int(duration_s)),
            "--format", "raw", "--threads", "--subprocesses", "--nonblocking", "--output", str(out),
        ] + (["--gil"] if gil else [])  # fmt: skip
        self._timer = threading.Timer(delay_s, self._start, (cmd,))
        self._timer.start()

    def _start(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    def stop(self) -> dict:
        self._timer.cancel()
        if self.proc is None:
            return {"py_spy": {"error": "the level ended before the profile started"}}
        _, err = self.proc.communicate(timeout=120)
        if not self.out.exists():
            return {"py_spy": {"error": err[-500:]}}
        return {"py_spy": stack_summary(self.out.read_text().splitlines()) | {"raw": self.out.name}}


def stack_summary(lines: list[str], top: int = 25) -> dict:
    """Where the samples of collapsed-stack ``lines`` went: per thread its share of all
    samples, and over all threads the ``top`` functions by self samples (the innermost
    frame) and the ``top`` omnistage functions by inclusive samples (on the stack at all),
    each as ``[frame, samples, share of all samples]``."""
    threads: dict[str, int] = {}
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():  # a process's command line may span lines
            continue
        count = int(count_text)
        frames = stack.split(";")
        if (
            frames[0].startswith("process ") and len(frames) > 1
        ):  # --subprocesses: process, then thread
            frames = [f"{frames[0].split(':', 1)[0]} {frames[1]}", *frames[2:]]
        total += count
        threads[frames[0]] = threads.get(frames[0], 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames[1:]):
            if "omnistage/" in frame:
                inclusive[frame] = inclusive.get(frame, 0) + count

    def ranked(counts: dict[str, int], n: int) -> list:
        return [
            [k, v, round(v / total, 4)]
            for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:n]
        ]

    return {
        "samples": total,
        "threads": ranked(threads, 40),
        "self": ranked(own, top),
        "inclusive": ranked(inclusive, top),
    }


def print_profile(name: str, profile: dict) -> None:
    """A :func:`stack_summary` as text: threads, then functions by self and inclusive share."""
    if "error" in profile:
        print(f"{name}: py-spy failed: {profile['error']}")
        return
    print(
        f"\n{name}: py-spy, {profile['samples']} samples of running threads at 100 Hz (share of all)"
    )
    for title in ("threads", "self", "inclusive"):
        print(f"  by {title}:")
        for frame, _, share in profile[title]:
            print(f"    {100 * share:5.1f}%  {frame[:150]}")


def first_audio_sums(base_url: str) -> dict[str, float]:
    """The server's TTFA sums so far from ``GET /metrics``: ``"ttfa_count"`` (requests that
    sent audio), ``"ttfa_s"`` (their summed TTFA, seconds) and per phase its summed seconds
    (``omnistage_request_phase_seconds_sum``, keyed by phase name).

    Raises:
        httpx.HTTPError: the server did not answer.
    """
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    response.raise_for_status()
    sums: dict[str, float] = {"ttfa_count": 0.0, "ttfa_s": 0.0}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "omnistage_request_phase_seconds_sum":
                sums[sample.labels["phase"]] = sample.value
            elif sample.name == "omnistage_time_to_first_audio_seconds_count":
                sums["ttfa_count"] = sample.value
            elif sample.name == "omnistage_time_to_first_audio_seconds_sum":
                sums["ttfa_s"] = sample.value
    return sums


def mean_phases_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The mean server-side TTFA decomposition (ms per phase, largest first, and ``"ttfa"``:
    their sum) of the requests that sent audio between two :func:`first_audio_sums`; empty
    when none did."""
    count = after["ttfa_count"] - before["ttfa_count"]
    if count <= 0:
        return {}
    phases = {
        k: (v - before.get(k, 0.0)) / count * 1e3
        for k, v in after.items()
        if k not in ("ttfa_count", "ttfa_s")
    }
    ranked = dict(
        sorted(((k, round(v, 2)) for k, v in phases.items() if v > 0), key=lambda kv: -kv[1])
    )
    return ranked | {"ttfa": round((after["ttfa_s"] - before["ttfa_s"]) / count * 1e3, 2)}


def stage_batch_sums(base_url: str) -> dict[str, dict[str, float]]:
    """Per stage and batch kind the server's batch sums so far from ``GET /metrics``:
    ``"batches"``, ``"seconds"`` (their summed wall time, ``omnistage_stage_batch_seconds``)
    and ``"requests"`` (their summed sizes, ``omnistage_stage_batch_size``), keyed by the
    stage's name, or ``stage.kind`` for kinds other than ``batch`` (an AR engine's
    ``tts_engine.prefill``, ``.mixed``, ``.decode``, ``.drain``).

    Raises:
        httpx.HTTPError: the server did not answer.
    """
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    response.raise_for_status()
    names = {"omnistage_stage_batch_seconds_count": "batches", "omnistage_stage_batch_seconds_sum": "seconds",
             "omnistage_stage_batch_size_sum": "requests"}  # fmt: skip
    sums: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in names:
                stage, kind = sample.labels["stage"], sample.labels.get("kind", "batch")
                key = stage if kind == "batch" else f"{stage}.{kind}"
                sums.setdefault(key, {})[names[sample.name]] = sample.value
    return sums


def stage_batches_between(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per stage that ran batches between two :func:`stage_batch_sums`: how many, their
    mean wall ms and their mean size (requests)."""
    out = {}
    for stage, now in after.items():
        then = before.get(stage, {})
        batches = now.get("batches", 0.0) - then.get("batches", 0.0)
        if batches > 0:
            out[stage] = {
                "batches": int(batches),
                "mean_ms": round((now["seconds"] - then.get("seconds", 0.0)) / batches * 1e3, 2),
                "mean_size": round((now["requests"] - then.get("requests", 0.0)) / batches, 1),
            }
    return out


def kernel_table(fn, top: int, calls: int = 5) -> list[dict]:  # noqa: ANN001 -- any callable
    """The CUDA kernels ``fn()`` launches, from ``torch.profiler`` over ``calls`` calls after
    one warm call (device-synchronized): per kernel name its device ms and launches per call
    and its share of the total, the ``top`` costliest, then a ``TOTAL`` row."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            row = totals.setdefault(event.name, [0.0, 0.0])
            row[0] += event.device_time / 1e3 / calls
            row[1] += 1 / calls
    total_ms = sum(ms for ms, _ in totals.values())
    rows = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [
        {"kernel": name[:110], "ms_per_call": ms, "launches_per_call": n, "share": ms / total_ms}
        for name, (ms, n) in rows
    ] + [{"kernel": "TOTAL", "ms_per_call": total_ms,
          "launches_per_call": sum(n for _, n in totals.values()), "share": 1.0}]  # fmt: skip
