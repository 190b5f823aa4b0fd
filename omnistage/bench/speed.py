"""Speed benchmark: latency, time to first audio and throughput of ``/v1/audio/speech``.

An HTTP client (httpx) against any running OpenAI-compatible speech server; it never imports
the server. Two kinds of level, cycling through the samples:

* closed loop, concurrency ``c``: ``c`` requests are kept in flight until ``num_requests``
  have completed;
* open loop, rate ``r`` (requests per second): ``num_requests`` requests are sent at
  Poisson arrival times (exponential gaps of mean ``1/r``, seeded), however many are in
  flight, as real traffic arrives.

Metrics, per request:

* **TTFA** (time to first audio, ms): request sent -> first response body byte received. With
  ``response_format="pcm"`` the body is raw audio, so this is the first audio byte; for a
  non-streaming request it is close to the full latency.
* **latency** (end-to-end, ms): request sent -> last body byte received.
* **audio duration** (s): samples received / sample rate. pcm is s16le mono, its rate taken
  from the ``X-Sample-Rate`` response header (24000 Hz, OpenAI's documented pcm rate, when
  the header is absent); wav is decoded with soundfile.
* **RTF** (real-time factor): generation wall time / audio duration = latency / duration;
  below 1 is faster than real time.

* **TTFA decomposition**: an omnistage server sends the request's timeline in the
  ``X-Timeline`` header (marks in ms after it received the request; see
  :mod:`omnistage.pipeline.timeline`). A phase is named by the mark that ends it; the
  last one, ``client``, is the client's TTFA minus the last server mark (the first byte's
  encoding, the network both ways, the client). Per level the mean of each phase is
  reported (a request without a mark counts 0 for it), so the phases sum to the mean TTFA.

Client processes (``client_processes`` > 1, closed loops only): the level's requests are
split over that many client processes, each with its own event loop, so a burst of
arrivals is not queued behind one process's CPU (about 1 ms per streamed request on the
development VM: building it, reading its chunks, decoding its pcm). Real clients are many
processes on many machines. At concurrency 128 against Qwen3-TTS on an H100, four
processes left the ``client`` phase where one had it (benchmarks/README.md).

Per level: TTFA, latency and RTF mean, p50/p90/p99 (linear-interpolated percentiles over
the successful requests) and maximum, audio throughput (seconds of audio per wall-clock
second of the level), request throughput (successful requests per wall-clock second),
failures and their first distinct error messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NoReturn

import httpx
import numpy as np
import soundfile
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from omnistage.bench.dataset import BenchSample

__all__ = [
    "DEFAULT_PCM_SAMPLE_RATE",
    "ClientPool",
    "Distribution",
    "LevelStats",
    "SpeechResult",
    "SpeechTarget",
    "SpeedOptions",
    "SpeedReport",
    "make_client",
    "mean_phases",
    "percentile",
    "plot_speed_report",
    "print_speed_report",
    "request_speech",
    "run_speed",
    "slowest_tenth",
    "split_closed_loop",
    "summarize_level",
    "ttfa_phases",
    "write_speed_json",
]

DEFAULT_PCM_SAMPLE_RATE = 24000  # OpenAI's documented rate for response_format="pcm"
MAX_ERRORS_KEPT = 5
TIMELINE_HEADER = "X-Timeline"  # omnistage.serve.app.TIMELINE_HEADER (no server import here)
CLIENT_PHASE = "client"


@dataclass(frozen=True)
class SpeechTarget:
    """Where and how to send speech requests.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1/audio/speech`` appended).
        model: the ``model`` field; omitted when ``None``.
        voice: the ``voice`` field; omitted when ``None``.
        api_key: sent as ``Authorization: Bearer <api_key>`` when set.
        extra_fields: more JSON fields merged into every request body (e.g. ``speed``).
        timeout_s: per-request timeout in seconds (connect, read and write).
    """

    base_url: str
    model: str | None = None
    voice: str | None = None
    api_key: str | None = None
    extra_fields: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/audio/speech"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, text: str, stream: bool, response_format: str) -> dict[str, Any]:
        """The JSON request body (the wire format, hence a dict)."""
        body: dict[str, Any] = {"input": text, "response_format": response_format, "stream": stream}
        if stream:
            body.update(stream_format="audio")
        body.update({k: v for k, v in (("model", self.model), ("voice", self.voice)) if v})
        body.update(self.extra_fields)
        return body


@dataclass(frozen=True)
class SpeechResult:
    """Outcome of one request; times in ms, ``audio_s`` in seconds (0 on failure).

    ``audio`` (float32 mono in [-1, 1] at ``sample_rate`` Hz) is kept only when asked for.
    ``ttfa_phases_ms``: the decomposition of ``ttfa_ms`` (module docstring), empty when the
    server sent no timeline.
    """

    sample_id: str
    ok: bool
    latency_ms: float
    ttfa_ms: float | None = None
    audio_s: float = 0.0
    sample_rate: int = 0
    error: str | None = None
    audio: np.ndarray | None = field(default=None, repr=False, compare=False)
    ttfa_phases_ms: tuple[tuple[str, float], ...] = ()


def _decode(body: bytes, response_format: str, rate_header: str | None) -> tuple[np.ndarray, int]:
    """(float32 mono audio, sample rate) of a response body."""
    if response_format == "pcm":
        rate = int(rate_header) if rate_header else DEFAULT_PCM_SAMPLE_RATE
        pcm = np.frombuffer(body[: len(body) // 2 * 2], dtype="<i2")
        return pcm.astype(np.float32) / 32768.0, rate
    data, rate = soundfile.read(io.BytesIO(body), dtype="float32", always_2d=True)
    return data.mean(axis=1), int(rate)


async def request_speech(
    client: httpx.AsyncClient,
    target: SpeechTarget,
    sample: BenchSample,
    *,
    stream: bool,
    response_format: str = "pcm",
    keep_audio: bool = False,
) -> SpeechResult:
    """Send one speech request and time it; never raises (failures are results)."""
    start = time.perf_counter()
    first: float | None = None
    try:
        body = target.body(sample.text, stream, response_format)
        async with client.stream("POST", target.url, json=body, headers=target.headers()) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")[:300]
                raise RuntimeError(f"HTTP {r.status_code}: {text}")
            chunks = []
            timeline = r.headers.get(TIMELINE_HEADER)
            async for chunk in r.aiter_bytes():
                if chunk:
                    first = first if first is not None else time.perf_counter()
                    chunks.append(chunk)
            rate_header = r.headers.get("X-Sample-Rate")
        end = time.perf_counter()
        audio, rate = _decode(b"".join(chunks), response_format, rate_header)
        if audio.size == 0 or first is None:
            raise RuntimeError("response contained no audio")
    except Exception as error:  # the client boundary: every failure becomes a result
        return SpeechResult(
            sample.id, False, (time.perf_counter() - start) * 1e3, error=_describe(error)
        )
    return SpeechResult(
        sample_id=sample.id,
        ok=True,
        latency_ms=(end - start) * 1e3,
        ttfa_ms=(first - start) * 1e3,
        audio_s=audio.size / rate,
        sample_rate=rate,
        audio=audio if keep_audio else None,
        ttfa_phases_ms=ttfa_phases(timeline, (first - start) * 1e3),
    )


def ttfa_phases(header: str | None, ttfa_ms: float) -> tuple[tuple[str, float], ...]:
    """The decomposition of ``ttfa_ms`` from an ``X-Timeline`` header value (``name=ms;...``,
    ms after the server received the request): one phase per mark after the first, named
    by it, then :data:`CLIENT_PHASE`; they sum to ``ttfa_ms``. Empty without a header or
    with a malformed one."""
    if not header:
        return ()
    try:
        marks = sorted(
            ((n, float(ms)) for n, _, ms in (m.partition("=") for m in header.split(";") if m)),
            key=lambda m: m[1],
        )
    except ValueError:
        return ()
    phases = [
        (name, at - before) for (_, before), (name, at) in zip(marks, marks[1:], strict=False)
    ]
    return (*phases, (CLIENT_PHASE, ttfa_ms - (marks[-1][1] if marks else 0.0)))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# ------------------------------------------------------------------------------ statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default).

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class Distribution:
    """Mean, p50/p90/p99 and maximum of a metric; all ``None`` when there were no values
    (the maximum answers "every stream": a level's RTF target holds for each request)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(None, None, None, None, None)
        mean = float(np.mean(np.asarray(values, dtype=np.float64)))
        return cls(mean, percentile(values, 50), percentile(values, 90), percentile(values, 99), float(max(values)))


@dataclass(frozen=True)
class LevelStats:
    """Aggregates of one concurrency level (see the module docstring for each metric).

    Attributes:
        concurrency: requests kept in flight (closed loop); for an open-loop level the most
            that were in flight at once.
        arrival_rate: requests per second of an open-loop level; None for a closed loop.
        num_requests: requests sent (successes + failures).
        num_ok, num_failed: their split.
        wall_s: wall-clock seconds of the level.
        ttfa_ms, latency_ms: distributions over successful requests, in ms.
        rtf: distribution of latency / audio duration over successful requests.
        audio_s_total: seconds of audio received.
        audio_throughput: ``audio_s_total / wall_s`` (audio seconds per second).
        request_throughput: ``num_ok / wall_s`` (requests per second).
        errors: first distinct error messages (at most 5).
        ttfa_phases_ms: mean ms per TTFA phase over successful requests (module
            docstring), in timeline order; they sum to ``ttfa_ms.mean``. Empty when the
            server sent no timelines.
        slowest_ttfa_phases_ms: the same means over the slowest tenth of the successful
            requests by TTFA (at least one request): where the tail (p90-p99) waits.
    """

    concurrency: int
    num_requests: int
    num_ok: int
    num_failed: int
    wall_s: float
    ttfa_ms: Distribution
    latency_ms: Distribution
    rtf: Distribution
    audio_s_total: float
    audio_throughput: float
    request_throughput: float
    errors: list[str]
    arrival_rate: float | None = None
    ttfa_phases_ms: dict[str, float] = field(default_factory=dict)
    slowest_ttfa_phases_ms: dict[str, float] = field(default_factory=dict)


def slowest_tenth(results: Sequence[SpeechResult]) -> list[SpeechResult]:
    """The slowest ``ceil(n / 10)`` of ``results`` by TTFA (those without a TTFA left out),
    slowest first."""
    timed = sorted((r for r in results if r.ttfa_ms is not None), key=lambda r: r.ttfa_ms or 0.0, reverse=True)
    return timed[: math.ceil(len(timed) / 10)]


def mean_phases(results: Sequence[SpeechResult]) -> dict[str, float]:
    """Mean ms per TTFA phase over ``results`` (0 where one lacks a phase), ordered by first
    appearance; empty unless every result has a decomposition."""
    if not results or not all(r.ttfa_phases_ms for r in results):
        return {}
    totals: dict[str, float] = {}
    for result in results:
        for name, ms in result.ttfa_phases_ms:
            totals[name] = totals.get(name, 0.0) + ms
    return {name: total / len(results) for name, total in totals.items()}


def summarize_level(
    concurrency: int,
    results: Sequence[SpeechResult],
    wall_s: float,
    arrival_rate: float | None = None,
) -> LevelStats:
    """Aggregate one level's results measured over ``wall_s`` seconds (> 0)."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    ok = [r for r in results if r.ok]
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors and len(errors) < MAX_ERRORS_KEPT:
            errors.append(r.error or "unknown error")
    audio_total = sum(r.audio_s for r in ok)
    return LevelStats(
        concurrency=concurrency,
        num_requests=len(results),
        num_ok=len(ok),
        num_failed=len(results) - len(ok),
        wall_s=wall_s,
        ttfa_ms=Distribution.of([r.ttfa_ms for r in ok if r.ttfa_ms is not None]),
        latency_ms=Distribution.of([r.latency_ms for r in ok]),
        rtf=Distribution.of([r.latency_ms / 1e3 / r.audio_s for r in ok if r.audio_s > 0]),
        audio_s_total=audio_total,
        audio_throughput=audio_total / wall_s,
        request_throughput=len(ok) / wall_s,
        errors=errors,
        arrival_rate=arrival_rate,
        ttfa_phases_ms=mean_phases(ok),
        slowest_ttfa_phases_ms=mean_phases(slowest_tenth(ok)),
    )


# ------------------------------------------------------------------------------ the run


@dataclass(frozen=True)
class SpeedOptions:
    """Options of a speed run (the CLI maps its flags onto these).

    Attributes:
        target: server, model, voice, key, extra fields, timeout.
        concurrencies: closed-loop levels to run, in order (each >= 1).
        rates: open-loop levels (requests per second, each > 0), run after the closed
            loops; at least one level of either kind.
        arrival_seed: seed of the open loop's Poisson arrival times.
        stream: request ``stream=true`` (audio arrives in chunks).
        num_requests: requests per level; ``None`` = ``max(len(samples), concurrency)``
            (open loop: ``max(len(samples), 10 x rate)``, about ten seconds of arrivals).
        warmup: unmeasured requests sent one by one before the first level.
        response_format: ``"pcm"`` (default) or ``"wav"`` (non-streaming only).
        show_progress: draw a rich progress bar.
        client_processes: client processes a closed-loop level's requests are split over
            (module docstring; 1: this process). Closed loops only: with ``rates`` it must
            be 1.
    """

    target: SpeechTarget
    concurrencies: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()
    arrival_seed: int = 0
    stream: bool = True
    num_requests: int | None = None
    warmup: int = 1
    response_format: str = "pcm"
    show_progress: bool = True
    client_processes: int = 1

    def __post_init__(self) -> None:
        if not (self.concurrencies or self.rates) or min(self.concurrencies, default=1) < 1:
            raise ValueError(
                f"concurrencies must be >= 1 (or rates given), got {self.concurrencies}"
            )
        if any(not (math.isfinite(rate) and rate > 0) for rate in self.rates):
            raise ValueError(f"rates must be > 0 requests per second, got {self.rates}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.warmup < 0 or self.response_format not in ("pcm", "wav"):
            raise ValueError("warmup must be >= 0 and response_format 'pcm' or 'wav'")
        if self.stream and self.response_format != "pcm":
            raise ValueError("streaming is measured with response_format='pcm'")
        if self.client_processes < 1 or (self.client_processes > 1 and self.rates):
            raise ValueError(
                f"client_processes must be >= 1, and 1 with open-loop rates; got {self.client_processes}"
            )


@dataclass(frozen=True)
class SpeedReport:
    """Result of a speed run: what was measured and one :class:`LevelStats` per level."""

    base_url: str
    model: str | None
    voice: str | None
    stream: bool
    response_format: str
    num_samples: int
    warmup: int
    started_at: str
    levels: list[LevelStats]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def _closed_loop(
    clients: ClientPool,
    options: SpeedOptions,
    samples: Sequence[BenchSample],
    indices: Sequence[int],
    concurrency: int,
    on_done: Callable[[], object] = lambda: None,
) -> list[SpeechResult]:
    """The requests of sample ``indices`` (modulo the samples), ``concurrency`` in flight."""
    jobs = iter(indices)
    results: list[SpeechResult] = []

    async def worker() -> None:
        for index in jobs:  # one shared iterator: each index is taken by one worker
            async with clients.client() as client:
                results.append(
                    await request_speech(
                        client,
                        options.target,
                        samples[index % len(samples)],
                        stream=options.stream,
                        response_format=options.response_format,
                    )
                )
            on_done()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(indices)))))
    return results


async def _run_level(
    clients: ClientPool | _ClientProcesses,
    options: SpeedOptions,
    samples: Sequence[BenchSample],
    concurrency: int,
    progress: Progress,
) -> LevelStats:
    total = options.num_requests or max(len(samples), concurrency)
    task = progress.add_task(f"concurrency {concurrency}", total=total)
    start = time.perf_counter()
    if isinstance(clients, _ClientProcesses):
        results = clients.closed_loop(range(total), concurrency)
        progress.advance(task, total)
    else:
        results = await _closed_loop(clients, options, samples, range(total), concurrency, lambda: progress.advance(task))
    return summarize_level(concurrency, results, time.perf_counter() - start)


class _ClientProcesses:
    """``options.client_processes`` spawned client processes, each a :class:`ClientPool`
    and an event loop of its own, started (imports done) before the first level.

    A closed level is split by :func:`split_closed_loop`.

    Raises:
        RuntimeError: a client process exited (its exit code named); the others are killed.
    """

    def __init__(self, options: SpeedOptions, samples: Sequence[BenchSample]) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipes: list[Connection] = []
        self._processes: list[BaseProcess] = []
        try:
            for _ in range(options.client_processes):
                parent, child = context.Pipe()
                process = context.Process(target=_client_process, args=(child, options, list(samples)), daemon=True)
                process.start()
                child.close()
                self._pipes.append(parent)
                self._processes.append(process)
            for index in range(len(self._pipes)):
                self._receive(index)  # "ready"
        except BaseException:
            self.close(kill=True)
            raise

    def closed_loop(self, indices: Sequence[int], concurrency: int) -> list[SpeechResult]:
        parts = split_closed_loop(indices, concurrency, len(self._pipes))
        for index, part in enumerate(parts):
            try:
                self._pipes[index].send(part)
            except BrokenPipeError:
                self._exited(index)
        return [result for index in range(len(parts)) for result in self._receive(index)]

    def _receive(self, index: int) -> list[SpeechResult]:
        try:
            return self._pipes[index].recv()
        except EOFError:
            self._exited(index)

    def _exited(self, index: int) -> NoReturn:
        self._processes[index].join(timeout=5)
        code = self._processes[index].exitcode
        self.close(kill=True)
        raise RuntimeError(f"client process {index} exited (code {code})")

    def close(self, kill: bool = False) -> None:
        """End the processes: closing their pipes ends them after their level; ``kill``
        (an error's path) does not wait for that."""
        for pipe in self._pipes:
            pipe.close()  # the process sees EOF and returns
        for process in self._processes:
            if not kill:
                process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def split_closed_loop(indices: Sequence[int], concurrency: int, processes: int) -> list[tuple[list[int], int]]:
    """A closed level of requests ``indices`` (non-empty) at ``concurrency`` (>= 1) split
    over at most ``processes`` (>= 1) client processes: ``(their request indices, their
    concurrency)`` for each of ``m = min(processes, c)`` of them, where ``c =
    min(concurrency, len(indices))`` is what can be in flight.

    The ``c`` is split as evenly as possible (``c // m``, +1 for the first ``c % m``) and
    the requests in proportion to it: the level's ``c`` slots are numbered, each belongs
    to one process, and request ``j`` goes to the owner of slot ``j mod c``. So every
    process runs about ``len(indices) / c`` rounds and they end together; an even split
    of the requests would leave the processes with fewer slots running alone at the end,
    below ``c`` in flight.
    """
    c = min(concurrency, len(indices))
    m = min(processes, c)
    shares = [c // m + (i < c % m) for i in range(m)]
    owner = [i for i, share in enumerate(shares) for _ in range(share)]
    parts: list[list[int]] = [[] for _ in range(m)]
    for j, index in enumerate(indices):
        parts[owner[j % c]].append(index)
    return list(zip(parts, shares, strict=True))


async def _run_open_level(
    clients: ClientPool,
    options: SpeedOptions,
    samples: Sequence[BenchSample],
    rate: float,
    progress: Progress,
) -> LevelStats:
    total = open_loop_requests(options, samples, rate)
    task = progress.add_task(f"rate {rate:g}/s", total=total)
    arrivals = np.cumsum(np.random.default_rng(options.arrival_seed).exponential(1 / rate, total))
    in_flight = peak = 0

    async def one(index: int, at: float) -> SpeechResult:
        nonlocal in_flight, peak
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            async with clients.client() as client:
                return await request_speech(
                    client, options.target, samples[index % len(samples)],
                    stream=options.stream, response_format=options.response_format,
                )  # fmt: skip
        finally:
            in_flight -= 1
            progress.advance(task)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, float(at)) for i, at in enumerate(arrivals)))
    return summarize_level(peak, results, time.perf_counter() - start, arrival_rate=rate)


def open_loop_requests(options: SpeedOptions, samples: Sequence[BenchSample], rate: float) -> int:
    """Requests of an open-loop level at ``rate`` (see :class:`SpeedOptions`)."""
    return options.num_requests or max(len(samples), math.ceil(10 * rate))


def make_client(
    target: SpeechTarget, connections: int, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """An AsyncClient allowing ``connections`` concurrent connections (no pool queueing)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=target.timeout_s, limits=limits, transport=transport)


class ClientPool:
    """One single-connection ``httpx.AsyncClient`` per request in flight, reused.

    Not one client with a pool of ``c`` connections: httpcore 1.0's pool does
    O(connections^2) bookkeeping under one lock on every request start and end
    (``AsyncConnectionPool._assign_requests_to_connections``), and at 128 connections a
    request waited a median 0.3 s in it before its headers were sent, which the server's
    timeline counts as the ``client`` phase (``benchmarks/http_cost.py``, 2026-12-01).
    The clients share one SSL context: a client that builds its own takes 18 ms, one that
    shares it 0.15 ms.
    """

    def __init__(self, target: SpeechTarget, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._target, self._transport = target, transport
        self._ssl = httpx.create_ssl_context()
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []

    @asynccontextmanager
    async def client(self) -> AsyncIterator[httpx.AsyncClient]:
        """An idle client (a new one if none is idle), for one request."""
        client = self._idle.pop() if self._idle else self._new()
        try:
            yield client
        finally:
            self._idle.append(client)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()

    def _new(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        client = httpx.AsyncClient(
            timeout=self._target.timeout_s, limits=limits, transport=self._transport, verify=self._ssl
        )
        self._all.append(client)
        return client


def _client_process(pipe: Connection, options: SpeedOptions, samples: list[BenchSample]) -> None:
    """A client process of :class:`_ClientProcesses`: says it is ready, then runs each
    ``(indices, concurrency)`` it is sent as a closed loop and sends the results back,
    until the pipe closes."""

    async def serve() -> None:
        clients = ClientPool(options.target)
        try:
            pipe.send([])
            while True:
                try:
                    indices, concurrency = pipe.recv()
                except EOFError:
                    return
                pipe.send(await _closed_loop(clients, options, samples, indices, concurrency))
        finally:
            await clients.aclose()

    asyncio.run(serve())


async def run_speed(
    options: SpeedOptions,
    samples: Sequence[BenchSample],
    transport: httpx.AsyncBaseTransport | None = None,
) -> SpeedReport:
    """Run every concurrency level of ``options`` against ``samples`` (non-empty).

    ``transport`` replaces httpx's network transport (tests pass an ``httpx.MockTransport``;
    not with client processes, which have their own).

    Raises:
        ValueError: no samples, or a ``transport`` with ``options.client_processes`` > 1.
        RuntimeError: a warm-up request failed, or a client process exited.
    """
    if not samples:
        raise ValueError("no samples to benchmark")
    if transport is not None and options.client_processes > 1:
        raise ValueError("client processes use the network: no transport with client_processes > 1")
    started = datetime.now(UTC).isoformat(timespec="seconds")
    clients = ClientPool(options.target, transport)
    processes = _ClientProcesses(options, samples) if options.client_processes > 1 else None
    failed = True
    try:
        for index in range(options.warmup):
            async with clients.client() as client:
                warm = await request_speech(
                    client,
                    options.target,
                    samples[index % len(samples)],
                    stream=options.stream,
                    response_format=options.response_format,
                )
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        with Progress(disable=not options.show_progress) as progress:
            levels = [await _run_level(processes or clients, options, samples, c, progress) for c in options.concurrencies]
            levels += [await _run_open_level(clients, options, samples, rate, progress) for rate in options.rates]
        failed = False
    finally:
        await clients.aclose()
        if processes is not None:  # an interrupted level's processes are killed, not awaited
            processes.close(kill=failed)
    return SpeedReport(
        base_url=options.target.base_url,
        model=options.target.model,
        voice=options.target.voice,
        stream=options.stream,
        response_format=options.response_format,
        num_samples=len(samples),
        warmup=options.warmup,
        started_at=started,
        levels=levels,
    )


# ------------------------------------------------------------------------------ output


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_speed_report(report: SpeedReport, console: Console | None = None) -> None:
    """Print one table row per concurrency level, then the errors seen."""
    console = console or Console()
    mode = "stream" if report.stream else "non-stream"
    table = Table(title=f"TTS speed: {report.base_url} ({mode}, {report.response_format})")
    for name in (
        "load",
        "ok/fail",
        "TTFA p50/p90/p99 ms",
        "latency p50/p90/p99 ms",
        "latency mean ms",
        "RTF mean/p50",
        "audio s/s",
        "req/s",
    ):
        table.add_column(name, justify="right")
    for s in report.levels:
        t, lat = s.ttfa_ms, s.latency_ms
        table.add_row(
            _load(s),
            f"{s.num_ok}/{s.num_failed}",
            f"{_fmt(t.p50)}/{_fmt(t.p90)}/{_fmt(t.p99)}",
            f"{_fmt(lat.p50)}/{_fmt(lat.p90)}/{_fmt(lat.p99)}",
            _fmt(lat.mean),
            f"{_fmt(s.rtf.mean, 3)}/{_fmt(s.rtf.p50, 3)}",
            _fmt(s.audio_throughput, 2),
            _fmt(s.request_throughput, 2),
        )
    console.print(table)
    _print_phases(report, console)
    for s in report.levels:
        for error in s.errors:
            console.print(f"[red]{_load(s)}: {error}[/red]")


def _load(level: LevelStats) -> str:
    """``c=8`` (closed loop) or ``8.0/s peak 12`` (open loop)."""
    if level.arrival_rate is None:
        return f"c={level.concurrency}"
    return f"{level.arrival_rate:g}/s peak {level.concurrency}"


def _print_phases(report: SpeedReport, console: Console) -> None:
    """The mean TTFA decomposition per level (levels with server timelines only)."""
    levels = [s for s in report.levels if s.ttfa_phases_ms]
    if not levels:
        return
    names = list(dict.fromkeys(name for s in levels for name in s.ttfa_phases_ms))
    table = Table(title="mean TTFA by phase, ms (each phase named by the mark that ends it)")
    for name in ("load", *names, "= TTFA mean"):
        table.add_column(name, justify="right")
    for s in levels:
        cells = [_fmt(s.ttfa_phases_ms.get(name, 0.0)) for name in names]
        table.add_row(_load(s), *cells, _fmt(s.ttfa_ms.mean))
        if s.slowest_ttfa_phases_ms:
            slow = [s.slowest_ttfa_phases_ms.get(name, 0.0) for name in names]
            table.add_row("  slowest 10%", *map(_fmt, slow), _fmt(sum(slow)))
    console.print(table)


def write_speed_json(report: SpeedReport, path: str | Path) -> None:
    """Write the report as indented JSON (UTF-8)."""
    Path(path).write_text(json.dumps(report.to_dict(), indent=2), encoding="utf-8")


def plot_speed_report(report: SpeedReport, path: str | Path) -> None:
    """Save a PNG: TTFA/latency percentiles and audio throughput against concurrency
    (closed-loop levels).

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from error
    closed = [s for s in report.levels if s.arrival_rate is None]
    x = [s.concurrency for s in closed]
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    for name, pick in (
        ("TTFA p50", lambda s: s.ttfa_ms.p50),
        ("TTFA p90", lambda s: s.ttfa_ms.p90),
        ("latency p50", lambda s: s.latency_ms.p50),
        ("latency p90", lambda s: s.latency_ms.p90),
    ):
        values = [pick(s) for s in closed]
        left.plot(x, [math.nan if v is None else v for v in values], marker="o", label=name)
    left.set(xlabel="concurrency", ylabel="ms", title="latency")
    left.legend()
    right.plot(x, [s.audio_throughput for s in closed], marker="o")
    right.set(xlabel="concurrency", ylabel="audio s / wall s", title="audio throughput")
    figure.tight_layout()
    figure.savefig(str(path), format="png")
