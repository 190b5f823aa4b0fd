"""A deterministic tone-generator speech model for server tests (not registered by
discovery; tests register it). Each character of ``input`` becomes 50 ms of a sine (or
square) wave whose pitch depends on the character, streamed one character per chunk.
``"FAIL"`` in the text fails before any audio; ``"LATEFAIL"`` fails after the first chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Self

import numpy as np
from pydantic import Field

from omnistage.config.pipeline import FactoryConfig, StageConfig
from omnistage.core.messages import StagePayload
from omnistage.core.payloads import AudioChunk, AudioResult
from omnistage.core.request import PipelineRequest
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import ItemResult, SimpleScheduler
from omnistage.serve.media import MediaPolicy
from omnistage.serve.model import SpeechModelConfig
from omnistage.serve.protocol import SpeechCapabilities, SpeechRequest

SAMPLE_RATE = 16000
CHAR_S = 0.05


@dataclass(frozen=True)
class ToneRequest(PipelineRequest):
    text: str
    voice: str
    speed: float
    max_chars: int
    delay_s: float


def tone_samples(request: ToneRequest) -> list[np.ndarray]:
    """The chunks the model streams for ``request``: one float32 array per character."""
    n = int(round(CHAR_S * SAMPLE_RATE / request.speed))
    t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
    chunks = []
    for char in request.text[: request.max_chars]:
        wave = np.sin(2 * np.pi * (200.0 + 5.0 * (ord(char) % 64)) * t)
        wave = np.sign(wave) if request.voice == "square" else wave
        chunks.append((0.5 * wave).astype(np.float32))
    return chunks


def tone_stage(ctx: StageBuildContext) -> SimpleScheduler:
    scheduler = SimpleScheduler(lambda batch: [])

    def compute(batch: list[StagePayload]) -> list[object]:
        out: list[object] = []
        for payload in batch:
            request: ToneRequest = payload.request
            if "FAIL" in request.text and "LATEFAIL" not in request.text:
                raise RuntimeError("tone: failing as asked")
            chunks = tone_samples(request)
            for i, chunk in enumerate(chunks):
                if i == 1 and "LATEFAIL" in request.text:
                    raise RuntimeError("tone: failing after the first chunk as asked")
                scheduler.outbox.stream(payload.request_id, AudioChunk(chunk, SAMPLE_RATE))
                time.sleep(request.delay_s)
            finish = "length" if len(request.text) > request.max_chars else "stop"
            result = AudioResult(
                sum(len(c) for c in chunks), SAMPLE_RATE, num_frames=len(chunks), input_tokens=len(request.text)
            )
            out.append(ItemResult(result, finish))
        return out

    scheduler.compute = compute
    return scheduler


class ToneSpeechRequest(SpeechRequest):
    """The tone model's schema: the framework's fields plus ``delay_s``."""

    delay_s: float = Field(default=0.0, ge=0.0, le=1.0, description="seconds to wait after each chunk")


class ToneConfig(SpeechModelConfig):
    architecture = "ToneGenerator"
    aliases = ("tone",)
    embedded_models = ("tone-test",)
    speech_request = ToneSpeechRequest

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        stage = StageConfig(
            name="tone",
            factory=FactoryConfig(path="omnistage.testing.tone:tone_stage"),
            terminal=True,
            result_type="omnistage.core.payloads:AudioResult",
            stream_types=["omnistage.core.payloads:AudioChunk"],
        )
        return cls(name="tone", model_path=model_path, stages=[stage])

    def capabilities(self) -> SpeechCapabilities:
        return SpeechCapabilities(
            model_names=("tone-test", "tone"),
            model_type="tone",
            supported_fields=frozenset({"speed", "max_new_tokens", "delay_s"}),
            voices=("sine", "square"),
            default_voice="sine",
            sample_rate=SAMPLE_RATE,
            stream_response_formats=frozenset({"pcm", "wav", "mp3", "flac", "opus", "aac"}),
        )

    def build_request(self, request: ToneSpeechRequest, media: MediaPolicy) -> ToneRequest:
        return ToneRequest(
            text=request.input,
            voice=request.voice or "sine",
            speed=request.speed,
            max_chars=request.max_new_tokens or 10_000,
            delay_s=request.delay_s,
        )
