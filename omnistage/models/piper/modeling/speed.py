"""``speed`` for Piper voices: a pitch-preserving time stretch of each synthesized sentence.

OpenAI defines ``speed`` as a factor on the speaking rate: the audio lasts ``1 / speed``
times as long. Piper's own knob, the phoneme length scale, is not linear: each phoneme's
frame count is ``ceil(w * length_scale)``, so short phonemes keep at least one frame: at
speed 4 the measured duration was 0.36-0.52 of the normal one instead of 0.25, and at 0.25
it was 3.3-3.7x instead of 4x, varying by text (en_US-joe-medium, four sentences, noise 0;
``python tools/piper_speed.py`` prints both mappings). The voice therefore always speaks at its own
length scale and the sentence is then stretched by Rubber Band (through Spotify's
pedalboard), whose output length is the input length divided by the factor, to the sample.
"""

from __future__ import annotations

import math

import numpy as np
import pedalboard

from omnistage.core.errors import RequestValidationError

__all__ = ["MAX_SPEED", "MIN_SPEED", "change_speed", "check_speed"]

MIN_SPEED = 0.25  # OpenAI /v1/audio/speech documents speed in [0.25, 4.0]
MAX_SPEED = 4.0


def check_speed(speed: float) -> float:
    """``speed`` itself if ``MIN_SPEED <= speed <= MAX_SPEED``.

    Raises:
        RequestValidationError: ``param="speed"`` otherwise (NaN included).
    """
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise RequestValidationError(
            f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed}", param="speed"
        )
    return speed


def change_speed(wave: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """Time-stretch ``wave`` to last ``1 / speed`` as long, pitch and formants kept.

    Args:
        wave: mono float32 ``[N]``.
        sample_rate: Hz.
        speed: within ``MIN_SPEED..MAX_SPEED``; 1 returns ``wave`` itself.

    Returns:
        float32 ``[N / speed]`` rounded to a whole sample (Rubber Band's offline length).
    """
    if speed == 1.0 or len(wave) == 0:
        return wave
    stretched = pedalboard.time_stretch(
        np.ascontiguousarray(wave, dtype=np.float32)[None, :], float(sample_rate), stretch_factor=speed
    )
    return stretched[0]
