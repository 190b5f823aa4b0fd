"""Intelligibility benchmark: synthesize, transcribe, and score word and character error rates.

Each sample is synthesized with a non-streaming ``response_format="wav"`` request, the audio
is transcribed by an :class:`~omnistage.bench.asr.ASRBackend`, and reference and hypothesis
go through the same :func:`normalize_for_wer` before jiwer scores them.

Metrics:

* **WER** (corpus): total word substitutions + deletions + insertions over all samples,
  divided by the total number of reference words (jiwer over the lists, not a mean of
  per-sample rates).
* **CER** (corpus): the same over characters of the normalized strings (spaces included).
* **throughput**: scored samples per wall-clock second, synthesis and ASR included.
* **RTF mean**: mean over samples of synthesis latency / audio duration (see
  :mod:`omnistage.bench.speed`).
* **worst**: the ``worst_n`` samples with the highest per-sample WER.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jiwer
from num2words import num2words
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from omnistage.bench.asr import ASRBackend
from omnistage.bench.dataset import BenchSample
from omnistage.bench.speed import SpeechTarget, make_client, request_speech

__all__ = [
    "SampleScore",
    "TranscribedSample",
    "WerOptions",
    "WerReport",
    "RunInfo",
    "build_wer_report",
    "normalize_for_wer",
    "print_wer_report",
    "run_wer",
    "write_wer_json",
]

# ------------------------------------------------------------------------------ normalizer

_MONEY = re.compile(r"\$(\d[\d,]*)(?:\.(\d\d))?\b")
_TIME = re.compile(r"\b(\d{1,2}):(\d\d)\b")
_ORDINAL = re.compile(r"(\d[\d,]*)(st|nd|rd|th)\b")
_NUMBER = re.compile(r"(?<!\d)(-)?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.(\d+))?")
_NOT_WORD = re.compile(r"[^\w\s']|_")
_LOOSE_APOSTROPHE = re.compile(r"(?<!\w)'|'(?!\w)")


def _cardinal(digits: str) -> str:
    """Words of an integer, American style: no "and", no hyphens or commas."""
    value = int(digits.replace(",", ""))
    words = (
        num2words(value, to="year")
        if 1100 <= value <= 1999 and "," not in digits
        else num2words(value)
    )
    return words.replace(" and ", " ").replace("-", " ").replace(",", "")


def _number(match: re.Match[str]) -> str:
    sign, whole, fraction = match.groups()
    words = ("minus " if sign else "") + _cardinal(whole)
    if fraction:
        words += " point " + " ".join(num2words(int(d)) for d in fraction)
    return f" {words} "


def _money(match: re.Match[str]) -> str:
    dollars, cents = match.groups()
    words = f" {dollars} {'dollar' if dollars == '1' else 'dollars'}"
    if cents and cents != "00":
        words += f" {int(cents)} {'cent' if cents == '01' else 'cents'}"
    return words + " "


def _time(match: re.Match[str]) -> str:
    hours, minutes = match.groups()
    if minutes == "00":
        return f" {hours} "
    return f" {hours} {'oh ' + minutes[1] if minutes[0] == '0' else minutes} "


# After punctuation became spaces: "a.m.", "a m", "A:M" are all "a m" by then, so the merge
# sees the same text on a second pass (the normalizer is idempotent).
_MERIDIEM = re.compile(r"\b([ap]) m\b")


def normalize_for_wer(text: str) -> str:
    """Canonical form of a transcript, applied to references and hypotheses alike.

    NFKC, lower case, "$5.50" -> "5 dollars 50 cents", "9:30" -> "9 30", "%" -> "percent",
    ordinals and numbers to words with num2words (American style: no "and"; integers
    1100-1999 without separators read as years, "1998" -> "nineteen ninety eight"; decimals
    digit by digit), then every character except letters, digits, whitespace and in-word
    apostrophes becomes a space, and whitespace is collapsed; last, the words "a m"/"p m"
    (from "a.m.", "p.m." and the like) become "am"/"pm" (an ASR writes them as one word).
    Idempotent: ``normalize_for_wer(normalize_for_wer(t)) == normalize_for_wer(t)``.
    """
    text = unicodedata.normalize("NFKC", text).lower()
    text = _MONEY.sub(_money, text)
    text = _TIME.sub(_time, text).replace("%", " percent ")
    text = _ORDINAL.sub(
        lambda m: " " + num2words(int(m[1].replace(",", "")), to="ordinal") + " ", text
    )
    text = _NUMBER.sub(_number, text)
    text = _LOOSE_APOSTROPHE.sub(" ", _NOT_WORD.sub(" ", text.replace("-", " ")))
    return _MERIDIEM.sub(r"\1m", " ".join(text.split()))


# ------------------------------------------------------------------------------ scoring


@dataclass(frozen=True)
class TranscribedSample:
    """One synthesized and transcribed sample (raw texts; latency ms, audio s)."""

    id: str
    reference: str
    hypothesis: str
    audio_s: float
    latency_ms: float


@dataclass(frozen=True)
class SampleScore:
    """Per-sample result with normalized texts and its own WER/CER (fractions, not %)."""

    id: str
    reference: str
    hypothesis: str
    wer: float
    cer: float


@dataclass(frozen=True)
class WerReport:
    """Result of a WER run (rates as fractions; see the module docstring)."""

    base_url: str
    model: str | None
    voice: str | None
    asr: str
    num_samples: int
    num_scored: int
    num_failed: int
    wer: float | None
    cer: float | None
    wall_s: float
    throughput: float
    rtf_mean: float | None
    worst: list[SampleScore]
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunInfo:
    """What a report was measured against: server, model, voice and ASR backend names."""

    base_url: str
    model: str | None
    voice: str | None
    asr: str


def _score(transcribed: Sequence[TranscribedSample]) -> tuple[list[SampleScore], list[str]]:
    """Per-sample scores, and an error for each sample whose reference normalizes to ""."""
    scores, unscorable = [], []
    for s in transcribed:
        ref, hyp = normalize_for_wer(s.reference), normalize_for_wer(s.hypothesis)
        if ref:
            scores.append(SampleScore(s.id, ref, hyp, jiwer.wer(ref, hyp), jiwer.cer(ref, hyp)))
        else:
            unscorable.append(f"{s.id}: empty reference after normalization")
    return scores, unscorable


def build_wer_report(
    transcribed: Sequence[TranscribedSample],
    failures: Sequence[str],
    wall_s: float,
    worst_n: int = 10,
    info: RunInfo | None = None,
) -> WerReport:
    """Score transcribed samples; samples with an empty normalized reference count as failed.

    Args:
        transcribed: successful samples.
        failures: one error message per failed sample.
        wall_s: wall-clock seconds of the whole run (> 0).
        worst_n: how many highest-WER samples to keep (>= 0).
        info: server/model/voice/ASR names for the report header.

    Raises:
        ValueError: ``wall_s`` <= 0.
    """
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    info = info or RunInfo("", None, None, "")
    scores, unscorable = _score(transcribed)
    errors = [*failures, *unscorable]
    refs, hyps = [s.reference for s in scores], [s.hypothesis for s in scores]
    rtfs = [s.latency_ms / 1e3 / s.audio_s for s in transcribed if s.audio_s > 0]
    return WerReport(
        base_url=info.base_url,
        model=info.model,
        voice=info.voice,
        asr=info.asr,
        num_samples=len(transcribed) + len(failures),
        num_scored=len(scores),
        num_failed=len(errors),
        wer=float(jiwer.wer(refs, hyps)) if scores else None,
        cer=float(jiwer.cer(refs, hyps)) if scores else None,
        wall_s=wall_s,
        throughput=len(scores) / wall_s,
        rtf_mean=sum(rtfs) / len(rtfs) if rtfs else None,
        worst=sorted(scores, key=lambda s: s.wer, reverse=True)[:worst_n],
        errors=errors[:5],
    )


# ------------------------------------------------------------------------------ the run


@dataclass(frozen=True)
class WerOptions:
    """Options of a WER run (the CLI maps its flags onto these).

    Attributes:
        target: server, model, voice, key, extra fields, timeout.
        concurrency: synthesis requests in flight (>= 1); ASR runs in worker threads.
        worst_n: highest-WER samples listed in the report.
        show_progress: draw a rich progress bar.
    """

    target: SpeechTarget
    concurrency: int = 4
    worst_n: int = 10
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.worst_n < 0:
            raise ValueError("concurrency must be >= 1 and worst_n >= 0")


async def _synthesize_and_transcribe(
    client: httpx.AsyncClient, options: WerOptions, sample: BenchSample, asr: ASRBackend
) -> TranscribedSample | str:
    """A transcribed sample, or the error message of its failure."""
    result = await request_speech(
        client, options.target, sample, stream=False, response_format="wav", keep_audio=True
    )
    if not result.ok or result.audio is None:
        return f"{sample.id}: {result.error}"
    try:
        text = await asyncio.to_thread(asr.transcribe, result.audio, result.sample_rate)
    except Exception as error:  # client boundary: a failed transcription fails one sample
        return f"{sample.id}: ASR {type(error).__name__}: {error}"
    return TranscribedSample(sample.id, sample.text, text, result.audio_s, result.latency_ms)


async def run_wer(
    options: WerOptions,
    samples: Sequence[BenchSample],
    asr: ASRBackend,
    transport: httpx.AsyncBaseTransport | None = None,
) -> WerReport:
    """Synthesize every sample (``options.concurrency`` at a time), transcribe and score.

    ``transport`` replaces httpx's network transport (tests pass an ``httpx.MockTransport``).
    """
    if not samples:
        raise ValueError("no samples to benchmark")
    gate = asyncio.Semaphore(options.concurrency)
    start = time.perf_counter()
    async with make_client(options.target, options.concurrency, transport) as client:
        with Progress(disable=not options.show_progress) as progress:
            task = progress.add_task("synthesize + transcribe", total=len(samples))

            async def one(sample: BenchSample) -> TranscribedSample | str:
                async with gate:
                    outcome = await _synthesize_and_transcribe(client, options, sample, asr)
                progress.advance(task)
                return outcome

            outcomes = await asyncio.gather(*(one(s) for s in samples))
    done = [o for o in outcomes if isinstance(o, TranscribedSample)]
    failed = [o for o in outcomes if isinstance(o, str)]
    t = options.target
    info = RunInfo(t.base_url, t.model, t.voice, asr.name)
    return build_wer_report(done, failed, time.perf_counter() - start, options.worst_n, info)


# ------------------------------------------------------------------------------ output


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.2f}%"


def print_wer_report(report: WerReport, console: Console | None = None) -> None:
    """Print the summary table, the worst samples and the first errors."""
    console = console or Console()
    summary = Table(title=f"TTS intelligibility: {report.base_url} (ASR: {report.asr})")
    for name in ("samples", "scored", "failed", "WER", "CER", "samples/s", "RTF mean"):
        summary.add_column(name, justify="right")
    rtf = "-" if report.rtf_mean is None else f"{report.rtf_mean:.3f}"
    summary.add_row(
        str(report.num_samples),
        str(report.num_scored),
        str(report.num_failed),
        _pct(report.wer),
        _pct(report.cer),
        f"{report.throughput:.2f}",
        rtf,
    )
    console.print(summary)
    worst = Table(title=f"worst {len(report.worst)} samples")
    for name in ("id", "WER", "reference", "hypothesis"):
        worst.add_column(name, overflow="fold")
    for s in report.worst:
        worst.add_row(s.id, _pct(s.wer), s.reference, s.hypothesis)
    console.print(worst)
    for error in report.errors:
        console.print(f"[red]{error}[/red]")


def write_wer_json(report: WerReport, path: str | Path) -> None:
    """Write the report as indented JSON (UTF-8)."""
    Path(path).write_text(json.dumps(report.to_dict(), indent=2), encoding="utf-8")
