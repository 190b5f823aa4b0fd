"""Result types shared by stages and the server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AudioResult:
    """An audio terminal stage's completion.

    Attributes:
        num_samples: samples streamed in total.
        sample_rate: Hz.
        num_frames: codec frames / synthesis units generated (model-defined; e.g. 12.5 Hz
            frames for Qwen3-TTS, sentences for Piper): the usage's ``output_tokens``.
        input_tokens: input units the model consumed (model-defined; e.g. talker prompt
            positions for Qwen3-TTS, phoneme ids for Piper): the usage's ``input_tokens``.
    """

    num_samples: int
    sample_rate: int
    num_frames: int = 0
    input_tokens: int = 0
