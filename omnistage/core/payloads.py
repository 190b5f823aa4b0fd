"""Payload and stream-item types shared by stages and the server.

The audio output convention of a speech model: its terminal stage streams
:class:`AudioChunk` items to the client and finishes with an :class:`AudioResult`.

Client input: :class:`InputText` is the text a client adds to a request while it runs.

The text output convention of a chat model: its text terminal stage streams
:class:`TextDelta` items and finishes with a :class:`TextResult`; a chat model that speaks
also has an audio terminal stage following the speech convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: ndarray fields have no boolean equality
class AudioChunk:
    """A piece of a request's audio, streamed to the client.

    Attributes:
        samples: ``[N] float32`` mono PCM in [-1, 1], on the host.
        sample_rate: Hz (the model's ``capabilities().sample_rate``).
    """

    samples: np.ndarray
    sample_rate: int


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


@dataclass(frozen=True)
class TextDelta:
    """Reply text streamed by a chat model's text terminal stage: ``text`` follows the
    text streamed before it (whole characters)."""

    text: str


@dataclass(frozen=True)
class InputText:
    """More input text of a running request, from its client (a stream chunk from
    :data:`~omnistage.core.messages.CLIENT_SOURCE`): ``text`` follows the text the request
    was submitted with and every ``InputText`` before it; any split, even inside a word."""

    text: str


@dataclass(frozen=True, kw_only=True)
class TextResult:
    """A chat model's text terminal stage's completion (its finish_reason travels in the
    framework's result).

    Attributes:
        text: the whole reply (the concatenation of the streamed :class:`TextDelta` s).
        prompt_tokens: prompt positions the model read, media placeholders included.
        completion_tokens: reply tokens generated (a stop token excluded).
        prompt_audio_tokens: of ``prompt_tokens``, positions holding audio.
        prompt_image_tokens: of ``prompt_tokens``, positions holding images or video.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    prompt_audio_tokens: int = 0
    prompt_image_tokens: int = 0
