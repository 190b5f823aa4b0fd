"""A speech model whose engine costs nothing: streamed pcm at Qwen3-TTS's chunk sizes and pace.

For measuring the serving path (coordinator, HTTP responses, sockets) alone: one terminal
stage, ``vocoder``, steps every ``step_ms`` (an engine step of a batched AR engine: one
12.5 Hz frame for every running stream) and, like Qwen3-TTS's vocoder, emits each stream's
audio in chunks of 1, 2, 4, then 8 frames of 1,920 samples (80 ms at 24 kHz), all the
chunks of a step as one :meth:`~omnistage.scheduling.base.StageOutbox.stream_many`. The
samples are a fixed tone (their values do not matter; their size does).

Served through the registry's extra entries (no checkpoint weights; ``config.json`` only)::

    PYTHONPATH=benchmarks OMNISTAGE_EXTRA_MODELS=paced_speech:PacedSpeechConfig \\
        omnistage serve --model-path DIR --vocoder.factory.args.step_ms 25

with ``DIR/config.json`` = ``{"architectures": ["PacedSpeechForBenchmark"]}``
(:func:`write_checkpoint`). A request's ``frames`` field sets its length; its ``padding``
(a string, ignored) makes its body as large as a measurement needs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np
from pydantic import Field

from omnistage.config.pipeline import FactoryConfig, StageConfig
from omnistage.core.messages import Abort, StagePayload
from omnistage.core.payloads import AudioChunk, AudioResult
from omnistage.core.request import PipelineRequest
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling.base import Scheduler
from omnistage.scheduling.vocoder import ChunkPlan
from omnistage.serve.media import MediaPolicy
from omnistage.serve.model import SpeechModelConfig
from omnistage.serve.protocol import SpeechCapabilities, SpeechRequest

ARCHITECTURE = "PacedSpeechForBenchmark"
SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1_920  # one 12.5 Hz frame at 24 kHz, as Qwen3-TTS's codec


def write_checkpoint(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(
        json.dumps({"architectures": [ARCHITECTURE]}), encoding="utf-8"
    )
    return out_dir


class PacedSpeechRequest(SpeechRequest):
    frames: int = Field(
        default=125, ge=1, le=10_000, description="12.5 Hz frames of audio to stream"
    )
    padding: str = Field(
        default="",
        max_length=16 * 1024 * 1024,
        description="ignored: makes the request body larger (http_cost.py --body-kib)",
    )


@dataclass(frozen=True)
class PacedJob(PipelineRequest):
    frames: int


@dataclass
class _Stream:
    frames_left: int
    chunk_index: int = 0
    pending: int = 0  # frames made, not emitted yet
    samples: int = 0


class PacedScheduler(Scheduler):
    """Every ``step_s``: one frame more for each running stream; a chunk out when its plan
    size is reached or the stream ends."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.plan = ChunkPlan()
        self.streams: dict[str, _Stream] = {}
        self.tone = (
            0.3 * np.sin(2 * np.pi * 220 * np.arange(8 * FRAME_SAMPLES) / SAMPLE_RATE)
        ).astype(np.float32)

    def live_requests(self) -> set[str]:
        return set(self.streams)

    def _run(self) -> None:
        next_step = time.monotonic()
        while True:
            wait = max(0.0, next_step - time.monotonic()) if self.streams else None
            for message in self.take(block=True, timeout=wait):
                if message is None:
                    return
                if isinstance(message, Abort):
                    self.streams.pop(message.request_id, None)
                    self.release(message.request_id)
                elif isinstance(message, StagePayload):
                    self.streams[message.request_id] = _Stream(message.request.frames)
            if self.streams and time.monotonic() >= next_step:
                next_step = max(next_step + self.step_s, time.monotonic() - self.step_s)
                self.run_batch(list(self.streams), self._step)

    def _step(self) -> None:
        emitted, finished = [], []
        for request_id, stream in self.streams.items():
            stream.frames_left -= 1
            stream.pending += 1
            if stream.pending == self.plan.size(stream.chunk_index) or stream.frames_left == 0:
                samples = self.tone[: stream.pending * FRAME_SAMPLES].copy()
                emitted.append((request_id, AudioChunk(samples, SAMPLE_RATE)))
                stream.samples += len(samples)
                stream.chunk_index += 1
                stream.pending = 0
            if stream.frames_left == 0:
                finished.append(request_id)
        if emitted:
            self.outbox.stream_many(emitted)
        for request_id in finished:
            stream = self.streams.pop(request_id)
            self.outbox.result(
                request_id, AudioResult(stream.samples, SAMPLE_RATE, stream.chunk_index)
            )


def create_stage(ctx: StageBuildContext, step_ms: float = 25.0) -> PacedScheduler:
    return PacedScheduler(step_ms / 1e3)


class PacedSpeechConfig(SpeechModelConfig):
    architecture = ARCHITECTURE
    speech_request = PacedSpeechRequest

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        return cls(
            name=f"paced_speech:{Path(model_path).name}",
            model_path=model_path,
            stages=[
                StageConfig(
                    name="vocoder",
                    factory=FactoryConfig(path="paced_speech:create_stage"),
                    terminal=True,
                    result_type="omnistage.core.payloads:AudioResult",
                    stream_types=["omnistage.core.payloads:AudioChunk"],
                )
            ],
        )

    def capabilities(self) -> SpeechCapabilities:
        return SpeechCapabilities(
            model_names=("paced-speech",),
            model_type="paced_speech",
            supported_fields=frozenset({"frames", "padding"}),
            voices=("tone",),
            default_voice="tone",
            sample_rate=SAMPLE_RATE,
            response_formats=frozenset({"pcm", "wav"}),
        )

    def build_request(self, request: PacedSpeechRequest, media: MediaPolicy) -> PacedJob:
        return PacedJob(request.frames)

    def sample_requests(self) -> list[PacedSpeechRequest]:
        return [PacedSpeechRequest(input="Hi.", frames=3)]
