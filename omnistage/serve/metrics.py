"""Prometheus metrics of one server instance.

Each :class:`ServerMetrics` owns its own ``CollectorRegistry`` (never the process-global
one), so several apps can live in one process (tests) without name clashes. Exposed
series (all prefixed ``omnistage_``):

================================================  =========  ===========================
name                                              kind       labels
================================================  =========  ===========================
``omnistage_requests_total``                      counter    ``status``, ``finish_reason``
``omnistage_time_to_first_audio_seconds``         histogram
``omnistage_request_phase_seconds``               histogram  ``phase``
``omnistage_request_latency_seconds``             histogram
``omnistage_real_time_factor``                    histogram
``omnistage_requests_in_flight``                  gauge
``omnistage_requests_queued``                     gauge
``omnistage_stage_queue_depth``                   gauge      ``stage``
``omnistage_stage_batch_size``                    histogram  ``stage``, ``kind``
``omnistage_stage_batch_seconds``                 histogram  ``stage``, ``kind``
================================================  =========  ===========================

The phases decompose each time to first audio: one observation per phase of a request's
timeline up to its first byte (:mod:`omnistage.pipeline.timeline`; a phase is named by the
mark that ends it), so per request they sum to its TTFA.

The per-stage series (queue depth, batch size and seconds) cover the stages hosted in the
server process; a stage in a stage process (``--<stage>.process``, local or Ray placement)
is not reported.

A stage's batches are labelled by ``kind``: an AR engine's step is ``prefill``, ``mixed``
(a prefill that also decodes the running requests), ``decode`` or ``drain`` (only the
in-flight step waited for); every other stage's batch is ``batch``. So a step's wall time
under load can be read apart by kind (a burst's prefills against the steady decode).

The real-time factor is processing time over produced audio time (``latency_s / audio_s``):
below 1 means faster than real time.
"""

from __future__ import annotations

import math

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from omnistage.scheduling.base import BatchKind

#: Time-to-first-audio buckets, seconds: 5 ms .. 10 s.
TTFA_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
)  # fmt: skip
#: Phase buckets, seconds: 0.1 ms .. 10 s.
PHASE_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
    0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: End-to-end latency buckets, seconds: 10 ms .. 10 min (long syntheses).
LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
#: Real-time-factor buckets (dimensionless): 0.01 .. 10.
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
#: Batch-size buckets (requests per batch): 1 .. 256.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Batch wall-time buckets, seconds: 0.5 ms .. 5 s (an engine step is 5-30 ms on a GPU).
BATCH_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0, 5.0,
)  # fmt: skip


def _check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class ServerMetrics:
    """The metrics of one server instance, in its own registry (``self.registry``).

    Lifecycle of a request: :meth:`request_started` when admitted to the pipeline,
    :meth:`first_audio` when its first audio chunk is ready, then exactly one
    :meth:`request_finished`. A request refused before admission (bad input, queue full)
    is counted with :meth:`request_rejected` instead. All methods are thread-safe.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "omnistage_requests", "Finished requests by HTTP status and finish reason.",
            ["status", "finish_reason"], registry=r,
        )  # fmt: skip
        self._ttfa = Histogram(
            "omnistage_time_to_first_audio_seconds",
            "Seconds from admission to the first audio chunk.",
            buckets=TTFA_BUCKETS, registry=r,
        )  # fmt: skip
        self._phase = Histogram(
            "omnistage_request_phase_seconds",
            "Seconds of one phase of the time to first audio (named by the mark that ends it).",
            ["phase"], buckets=PHASE_BUCKETS, registry=r,
        )  # fmt: skip
        self._latency = Histogram(
            "omnistage_request_latency_seconds",
            "Seconds from admission to the end of the request.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._rtf = Histogram(
            "omnistage_real_time_factor",
            "Processing seconds per second of audio produced.",
            buckets=RTF_BUCKETS, registry=r,
        )  # fmt: skip
        self._in_flight = Gauge(
            "omnistage_requests_in_flight", "Requests admitted and not finished.", registry=r
        )
        self._queued = Gauge(
            "omnistage_requests_queued", "Admitted requests not yet picked up.", registry=r
        )
        self._stage_depth = Gauge(
            "omnistage_stage_queue_depth", "Items waiting in a stage's input queue.",
            ["stage"], registry=r,
        )  # fmt: skip
        self._batch = Histogram(
            "omnistage_stage_batch_size", "Requests per batch a stage computed.",
            ["stage", "kind"], buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self._batch_seconds = Histogram(
            "omnistage_stage_batch_seconds",
            "Wall seconds of one batch of a stage (an AR engine's: one step, launched and "
            "waited for), failed batches included.",
            ["stage", "kind"], buckets=BATCH_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip

    def request_started(self) -> None:
        """A request was admitted: in-flight + 1."""
        self._in_flight.inc()

    def first_audio(self, ttfa_s: float) -> None:
        """Record the time to first audio, seconds (>= 0). Raises ValueError otherwise."""
        _check_non_negative("ttfa_s", ttfa_s)
        self._ttfa.observe(ttfa_s)

    def first_audio_phases(self, phases: list[tuple[str, float]]) -> None:
        """Record the phases ``(name, seconds >= 0)`` of one request's time to first audio.

        Raises:
            ValueError: a negative or non-finite duration (nothing recorded).
        """
        for name, seconds in phases:
            _check_non_negative(f"phase {name}", seconds)
        for name, seconds in phases:
            self._phase.labels(name).observe(seconds)

    def request_finished(
        self, status: int, finish_reason: str | None, latency_s: float, audio_s: float = 0.0
    ) -> None:
        """An admitted request ended (success or failure): in-flight - 1, count it.

        Args:
            status: HTTP status answered (or, for a stream, the one its outcome maps to).
            finish_reason: e.g. ``"stop"``, ``"length"``, ``"abort"``, ``"error"``;
                ``None`` is counted as ``"none"``.
            latency_s: seconds from admission to the end, >= 0.
            audio_s: seconds of audio produced, >= 0; the RTF is observed only when > 0.

        Raises:
            ValueError: ``latency_s`` or ``audio_s`` negative or not finite (nothing recorded).
        """
        _check_non_negative("latency_s", latency_s)
        _check_non_negative("audio_s", audio_s)
        self._in_flight.dec()
        self._requests.labels(str(status), finish_reason or "none").inc()
        self._latency.observe(latency_s)
        if audio_s > 0:
            self._rtf.observe(latency_s / audio_s)

    def request_rejected(self, status: int) -> None:
        """Count a request refused before admission (finish_reason ``"rejected"``)."""
        self._requests.labels(str(status), "rejected").inc()

    def set_queued(self, n: int) -> None:
        """Set the number of admitted requests waiting to be picked up (>= 0)."""
        _check_non_negative("n", n)
        self._queued.set(n)

    def set_stage_queue_depth(self, stage: str, n: int) -> None:
        """Set the number of items waiting in ``stage``'s input queue (>= 0)."""
        _check_non_negative("n", n)
        self._stage_depth.labels(stage).set(n)

    def observe_batch(self, stage: str, size: int, seconds: float, kind: BatchKind = "batch") -> None:
        """Record that ``stage`` computed a batch of ``size`` requests (>= 1) of ``kind``
        (module docstring) in ``seconds`` of wall time (>= 0).

        Raises:
            ValueError: ``size`` < 1, or ``seconds`` negative or not finite (nothing recorded).
        """
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        _check_non_negative("seconds", seconds)
        self._batch.labels(stage, kind).observe(size)
        self._batch_seconds.labels(stage, kind).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
