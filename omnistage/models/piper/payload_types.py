"""Typed pipeline state of the Piper voice pipeline."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.core.request import PipelineRequest


@dataclass(frozen=True)
class PiperRequest(PipelineRequest):
    """A validated synthesis request (built by :mod:`.request_builders`).

    Attributes:
        sentences: normalized sentences, in order (non-empty).
        length_scale: phoneme length multiplier (the voice's own).
        noise_scale: generator noise (0 = deterministic audio).
        noise_w: duration noise (0 = deterministic durations).
        speaker_id: speaker of a multi-speaker voice; None for single-speaker voices.
        speed: OpenAI speed factor (0.25..4): each sentence is time-stretched to last
            1 / speed as long (:mod:`.modeling.speed`).
    """

    sentences: tuple[str, ...]
    length_scale: float
    noise_scale: float
    noise_w: float
    speaker_id: int | None = None
    speed: float = 1.0


@dataclass(frozen=True)
class PhonemizedText:
    """Output of the preprocessing stage: phoneme ids per sentence, in order."""

    sentences: tuple[tuple[int, ...], ...]
