"""The toy model's stages: ``score`` (batching: request -> :class:`Score`) and ``synth``
(terminal: one 50 ms :class:`AudioChunk` per tone at :data:`SAMPLE_RATE`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnistage.core.messages import StagePayload
from omnistage.core.payloads import AudioChunk, AudioResult
from omnistage.core.request import PipelineRequest
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import SimpleScheduler

SAMPLE_RATE = 16_000
TONE_S = 0.05


@dataclass(frozen=True)
class ToySpeechRequest(PipelineRequest):
    """The pipeline's request: ``text``, the voice's base pitch (Hz), ``pitch_shift``
    (semitones) and ``brightness`` (0..1, weight of the upper harmonics)."""

    text: str
    base_hz: float
    pitch_shift: float
    brightness: float


@dataclass(frozen=True)
class Score:
    """``score``'s output: one frequency (Hz) per spoken character, and the harmonic
    weights ``[H]`` (float64)."""

    frequencies: tuple[float, ...]
    weights: np.ndarray


def harmonics(model_path: str | None) -> np.ndarray:
    assert model_path is not None
    return np.asarray(json.loads((Path(model_path) / "config.json").read_text())["harmonics"])


def create_score_stage(ctx: StageBuildContext, max_batch_size: int = 8) -> SimpleScheduler:
    amplitudes = harmonics(ctx.pipeline.model_path)

    def compute(batch: list[StagePayload]) -> list[object]:
        out: list[object] = []
        for payload in batch:
            request: ToySpeechRequest = payload.request
            base = request.base_hz * 2 ** (request.pitch_shift / 12)
            frequencies = tuple(base * (1 + (ord(c) % 12) / 12) for c in request.text if not c.isspace())
            tilt = request.brightness ** np.arange(len(amplitudes))
            out.append(Score(frequencies, amplitudes * tilt))
        return out

    return SimpleScheduler(compute, max_batch_size)


def create_synth_stage(ctx: StageBuildContext) -> SimpleScheduler:
    scheduler = SimpleScheduler(lambda batch: [])
    t = np.arange(int(TONE_S * SAMPLE_RATE)) / SAMPLE_RATE

    def compute(batch: list[StagePayload]) -> list[object]:
        out: list[object] = []
        for payload in batch:
            score: Score = payload.data
            for f in score.frequencies:
                wave = sum(w * np.sin(2 * np.pi * f * (k + 1) * t) for k, w in enumerate(score.weights))
                chunk = (0.5 * wave / score.weights.sum()).astype(np.float32)
                scheduler.outbox.stream(payload.request_id, AudioChunk(chunk, SAMPLE_RATE))
            out.append(AudioResult(len(score.frequencies) * len(t), SAMPLE_RATE, len(score.frequencies)))
        return out

    scheduler.compute = compute
    return scheduler
