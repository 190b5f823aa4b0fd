"""``omnistage bench speed|wer``: thin wrappers over :mod:`omnistage.bench`."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from typer.core import TyperCommand

from omnistage.bench import (
    ASRBackend,
    BenchSample,
    PocketSphinxASR,
    SpeechTarget,
    SpeedOptions,
    WerOptions,
    WhisperASR,
    load_samples,
    plot_speed_report,
    print_speed_report,
    print_wer_report,
    run_speed,
    run_wer,
    write_speed_json,
    write_wer_json,
)
from omnistage.cli.options import API_KEY_ENV, fail, option_group

__all__ = ["bench_app", "parse_extra_fields", "spread_option_values"]

bench_app = typer.Typer(
    help="Benchmark a running speech server (omnistage or any OpenAI-compatible one).",
    no_args_is_help=True,
)
#: Request fields the benchmark sets itself (some through their own flags).
RESERVED_FIELDS = frozenset(
    {"input", "text", "model", "voice", "speaker", "stream", "stream_format", "response_format"}
)


def spread_option_values(args: list[str], names: tuple[str, ...]) -> list[str]:
    """Rewrite ``--opt 1 4 16`` as ``--opt 1 --opt 4 --opt 16`` for the options in ``names``
    (bare tokens after the option's value belong to it; the commands take no arguments)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        out.append(token)
        i += 1
        if token == "--":
            return out + args[i:]
        name, eq, _ = token.partition("=")
        if name not in names:
            continue
        if not eq and i < len(args):
            out.append(args[i])
            i += 1
        while i < len(args) and not args[i].startswith("-"):
            out += [name, args[i]]
            i += 1
    return out


class _SpreadConcurrencyCommand(TyperCommand):
    """A command whose ``--concurrency`` and ``--rate`` take several values (``--concurrency 1 4 16``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_option_values(args, ("--concurrency", "--rate")))


def parse_extra_fields(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` items -> request fields; VALUE is JSON when it parses, else a string.
    Exits with status 2 on a malformed, repeated or reserved field."""
    fields: dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name:
            fail(f"--extra {item!r}: expected FIELD=VALUE")
        if name in RESERVED_FIELDS:
            fail(f"--extra {name}: set by the benchmark (use --model, --voice, --stream)")
        if name in fields:
            fail(f"--extra {name}: given twice")
        try:
            fields[name] = json.loads(text)
        except json.JSONDecodeError:
            fields[name] = text
    return fields


def _check_writable(path: Path | None, option: str) -> None:
    if path is not None and not path.parent.is_dir():
        fail(f"{option} {path}: directory {str(path.parent)!r} does not exist")


@dataclass(frozen=True)
class TargetArgs:
    """The options shared by the bench commands: server, request fields, texts, output."""

    base_url: Annotated[str, typer.Option(help="Server root URL.")] = "http://127.0.0.1:8000"
    meta_lst: Annotated[
        Path | None,
        typer.Option(
            help="seed-tts-eval meta.lst (id|ref_text|ref_audio|text) \\[default: built-in sentences].",
            exists=True,
            dir_okay=False,
            show_default=False,
        ),
    ] = None
    limit: Annotated[
        int | None, typer.Option(help="Use only the first N texts.", min=1, show_default=False)
    ] = None
    api_key: Annotated[
        str | None,
        typer.Option(help="Bearer token for the server.", envvar=API_KEY_ENV, show_default=False),
    ] = None
    model: Annotated[
        str | None, typer.Option(help="The request's model field.", show_default=False)
    ] = None
    voice: Annotated[
        str | None, typer.Option(help="The request's voice field.", show_default=False)
    ] = None
    extra: Annotated[
        list[str] | None,
        typer.Option(
            help="Extra request field, VALUE parsed as JSON (else a string), e.g. speed=1.5; repeatable.",
            metavar="FIELD=VALUE",
            show_default=False,
        ),
    ] = None
    timeout: Annotated[float, typer.Option(help="Per-request timeout in seconds.", min=0.001)] = (
        300.0
    )
    output: Annotated[
        Path | None,
        typer.Option(
            help="Write the report as JSON to this file.", dir_okay=False, show_default=False
        ),
    ] = None

    def speech_target(self) -> SpeechTarget:
        fields = parse_extra_fields(self.extra or [])
        return SpeechTarget(
            self.base_url, self.model, self.voice, self.api_key, fields, self.timeout
        )

    def samples(self) -> list[BenchSample]:
        try:
            return load_samples(self.meta_lst, self.limit)
        except (OSError, ValueError) as exc:
            fail(f"--meta-lst {self.meta_lst}: {exc}")


def _console() -> Console:
    """stdout console; piped output gets wide tables instead of rich's 80 columns."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _exit_on_failures(failed: int, total: int) -> None:
    if failed:
        fail(f"{failed} of {total} requests failed", code=1)


class ResponseFormat(StrEnum):
    pcm = "pcm"
    wav = "wav"


@dataclass(frozen=True)
class SpeedArgs:
    """The options of ``bench speed`` only."""

    concurrency: Annotated[
        list[int] | None,
        typer.Option(
            help="Closed-loop level(s), run in order: --concurrency 1 4 16, or repeat the flag. "
            "\\[default: 1, unless --rate is given]",
            min=1,
            show_default=False,
        ),
    ] = None
    rate: Annotated[
        list[float] | None,
        typer.Option(
            help="Open-loop level(s): Poisson arrivals at this many requests per second, run "
            "after the concurrency levels: --rate 2 5, or repeat the flag.",
            min=0.001,
            show_default=False,
        ),
    ] = None
    stream: Annotated[bool, typer.Option(help="Request streamed audio.")] = True
    num_requests: Annotated[
        int | None,
        typer.Option(
            help="Requests per level \\[default: max(texts, concurrency)].",
            min=1,
            show_default=False,
        ),
    ] = None
    warmup: Annotated[
        int, typer.Option(help="Unmeasured requests before the first level.", min=0)
    ] = 1
    response_format: Annotated[
        ResponseFormat, typer.Option(help="Audio format (wav: --no-stream only).")
    ] = ResponseFormat.pcm
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Save a PNG chart here (needs matplotlib).", dir_okay=False, show_default=False
        ),
    ] = None
    client_processes: Annotated[
        int,
        typer.Option(
            help="Client processes a concurrency level's requests are split over (each its "
            "own event loop), so a burst of requests is not queued behind one client's CPU; "
            "concurrency levels only (not with --rate).",
            min=1,
        ),
    ] = 1

    def options(self, target: SpeechTarget) -> SpeedOptions:
        """The run's options; exits with status 2 on flags that do not go together."""
        if self.stream and self.response_format is ResponseFormat.wav:
            fail("--response-format wav is measured with --no-stream only")
        if self.client_processes > 1 and self.rate:
            fail("--client-processes applies to --concurrency levels only, not with --rate")
        if self.plot is not None and importlib.util.find_spec("matplotlib") is None:
            fail("--plot needs matplotlib: pip install matplotlib")
        _check_writable(self.plot, "--plot")
        return SpeedOptions(
            target,
            concurrencies=tuple(self.concurrency or (() if self.rate else (1,))),
            rates=tuple(self.rate or ()),
            stream=self.stream,
            num_requests=self.num_requests,
            warmup=self.warmup,
            response_format=self.response_format.value,
            show_progress=sys.stdout.isatty(),
            client_processes=self.client_processes,
        )


@bench_app.command("speed", cls=_SpreadConcurrencyCommand)
@option_group(TargetArgs, "target")
@option_group(SpeedArgs, "run")
def speed(*, target: TargetArgs, run: SpeedArgs) -> None:
    """Time to first audio (and its decomposition), latency, RTF and throughput per
    concurrency level (closed loop) and per arrival rate (open loop)."""
    _check_writable(target.output, "--output")
    options = run.options(target.speech_target())
    report = asyncio.run(run_speed(options, target.samples()))
    print_speed_report(report, _console())
    if target.output is not None:
        write_speed_json(report, target.output)
    if run.plot is not None:
        plot_speed_report(report, run.plot)
    failed = sum(s.num_failed for s in report.levels)
    _exit_on_failures(failed, sum(s.num_requests for s in report.levels))


class ASRName(StrEnum):
    pocketsphinx = "pocketsphinx"
    whisper = "whisper"


def _make_asr(name: ASRName, whisper_model_dir: Path | None, device: str) -> ASRBackend:
    if name is ASRName.pocketsphinx:
        if whisper_model_dir is not None:
            fail("--whisper-model-dir only applies to --asr whisper")
        return PocketSphinxASR()
    if whisper_model_dir is None:
        fail("--asr whisper needs --whisper-model-dir DIR (a local Whisper checkpoint)")
    try:
        return WhisperASR(whisper_model_dir, device=device)
    except ImportError as exc:
        fail(str(exc), code=1)
    except Exception as exc:
        fail(f"--whisper-model-dir {whisper_model_dir}: cannot load Whisper: {exc}")


@dataclass(frozen=True)
class WerArgs:
    """The options of ``bench wer`` only."""

    asr: Annotated[ASRName, typer.Option(help="Speech recognizer scoring the audio.")] = (
        ASRName.pocketsphinx
    )
    whisper_model_dir: Annotated[
        Path | None,
        typer.Option(
            help="Local Whisper checkpoint (with --asr whisper).",
            exists=True,
            file_okay=False,
            show_default=False,
        ),
    ] = None
    whisper_device: Annotated[str, typer.Option(help="Torch device for Whisper.")] = "cpu"
    concurrency: Annotated[int, typer.Option(help="Synthesis requests in flight.", min=1)] = 4
    worst: Annotated[int, typer.Option(help="List the N samples with the highest WER.", min=0)] = 10


@bench_app.command("wer")
@option_group(TargetArgs, "target")
@option_group(WerArgs, "run")
def wer(*, target: TargetArgs, run: WerArgs) -> None:
    """Intelligibility: synthesize each text, transcribe it, and score WER and CER."""
    _check_writable(target.output, "--output")
    backend = _make_asr(run.asr, run.whisper_model_dir, run.whisper_device)
    options = WerOptions(target.speech_target(), run.concurrency, run.worst, sys.stdout.isatty())
    report = asyncio.run(run_wer(options, target.samples(), backend))
    print_wer_report(report, _console())
    if target.output is not None:
        write_wer_json(report, target.output)
    _exit_on_failures(report.num_failed, report.num_samples)
