"""Typed pipeline state of the Piper voice pipeline."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PiperRequest:
    """A validated synthesis request (built by :mod:`.request_builders`).

    Attributes:
        sentences: normalized sentences, in order (non-empty).
        length_scale: phoneme length multiplier (the voice's default / speed).
        noise_scale: generator noise (0 = deterministic audio).
        noise_w: duration noise (0 = deterministic durations).
        speaker_id: speaker of a multi-speaker voice; None for single-speaker voices.
    """

    sentences: tuple[str, ...]
    length_scale: float
    noise_scale: float
    noise_w: float
    speaker_id: int | None = None


@dataclass(frozen=True)
class PhonemizedText:
    """Output of the preprocessing stage: phoneme ids per sentence, in order."""

    sentences: tuple[tuple[int, ...], ...]
