"""The short soak run (issue 12): 1,000 mixed requests at concurrency 64 against the Piper
voice and a tiny Qwen3-TTS, 10 % client aborts and injected faults in every stage, through
the committed driver ``benchmarks/soak.py`` in its own process; every pass criterion holds
(no hang, no unexplained outcome, no leaked state, RSS within 10 % of after the warm-up,
healthy at the end, faults really fired)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_the_short_soak_run_passes_every_criterion(tmp_path: Path):
    report_path = tmp_path / "soak.json"
    command = [sys.executable, str(ROOT / "benchmarks/soak.py"), "--requests", "1000",
               "--concurrency", "64", "--output", str(report_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=850)
    assert report_path.exists(), done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["passed"], json.dumps(
        {k: report[k] for k in ("criteria", "outcomes", "unexplained", "leaks")}
    )
    assert done.returncode == 0
    outcomes = report["outcomes"]
    assert outcomes["ok"] > 500 and outcomes["client_abort"] > 50 and outcomes["rejected_400"] > 0
    surfaced = sum(v for k, v in outcomes.items() if k.endswith("_surfaced"))
    assert surfaced > 0, outcomes  # injected failures reached clients, typed
