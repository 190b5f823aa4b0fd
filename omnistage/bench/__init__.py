"""Benchmark clients for any running omnistage (or OpenAI-compatible) speech server.

They talk HTTP only and never import the server:

* :mod:`.speed`: TTFA, latency, RTF and throughput per concurrency level.
* :mod:`.wer`: intelligibility (WER/CER) by transcribing synthesized audio with an
  :mod:`.asr` backend.
* :mod:`.dataset` / :mod:`.sentences`: the texts (seed-tts-eval ``meta.lst`` or built-in).
"""

from omnistage.bench.asr import ASRBackend, PocketSphinxASR, WhisperASR
from omnistage.bench.dataset import BenchSample, builtin_samples, load_meta_lst, load_samples
from omnistage.bench.speed import (
    SpeechTarget,
    SpeedOptions,
    SpeedReport,
    plot_speed_report,
    print_speed_report,
    run_speed,
    write_speed_json,
)
from omnistage.bench.wer import (
    WerOptions,
    WerReport,
    normalize_for_wer,
    print_wer_report,
    run_wer,
    write_wer_json,
)

__all__ = [
    "ASRBackend",
    "BenchSample",
    "PocketSphinxASR",
    "SpeechTarget",
    "SpeedOptions",
    "SpeedReport",
    "WerOptions",
    "WerReport",
    "WhisperASR",
    "builtin_samples",
    "load_meta_lst",
    "load_samples",
    "normalize_for_wer",
    "plot_speed_report",
    "print_speed_report",
    "print_wer_report",
    "run_speed",
    "run_wer",
    "write_speed_json",
    "write_wer_json",
]
