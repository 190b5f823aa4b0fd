"""The Qwen3-Omni chat request: its ``/v1/chat/completions`` schema and the builder of the
pipeline's :class:`~.payload_types.Qwen3OmniRequest` from a validated request whose media
the framework decoded (:mod:`omnistage.serve.chat_media`)."""

from __future__ import annotations

import math
import secrets

from PIL import Image
from pydantic import Field

from omnistage.core.errors import RequestValidationError
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest, TalkerSampling
from omnistage.models.qwen3_omni.processing import SAMPLE_RATE, ChatMessage, ChatPart
from omnistage.serve.chat_media import ChatAudio, ChatContent, ChatImage, ChatText, ChatTurn
from omnistage.serve.chat_protocol import ChatCompletionRequest
from omnistage.serve.media import resample

FRAMES_PER_SECOND = 12.5  # talker frames (80 ms each)
#: The talker's frame cap when the request sets no ``max_audio_seconds``: transformers'
#: ``talker_max_new_tokens`` default (4096 frames, 327.68 s). The reply-proportional cap of
#: the talker stage (:func:`.stages.talker_frame_cap`) is lower for any reply it can speak.
DEFAULT_MAX_AUDIO_FRAMES = 4096
_SEED_MAX = 2**31 - 1  # the engine sampler's seed range


class Qwen3OmniChatRequest(ChatCompletionRequest):
    """``POST /v1/chat/completions`` for Qwen3-Omni: OpenAI's fields and the framework's
    ``top_k``, with ``seed`` in the sampler's range, plus its own ``max_audio_seconds``."""

    seed: int | None = Field(default=None, ge=0, le=_SEED_MAX, description="sampler seed (0..2**31-1)")
    max_audio_seconds: float | None = Field(
        default=None, gt=0.0, le=DEFAULT_MAX_AUDIO_FRAMES / FRAMES_PER_SECOND,
        description="speech of the reply at most, seconds (12.5 talker frames per second)",
    )  # fmt: skip


def build_chat_request(
    req: Qwen3OmniChatRequest, turns: tuple[ChatTurn, ...], speakers: tuple[str, ...], default_max_tokens: int
) -> Qwen3OmniRequest:
    """The pipeline's request: the turns' text and audio (resampled to the feature
    extractor's 16 kHz) as :class:`ChatMessage` s, the speaker, sampling and caps.

    Sampling: unset ``temperature`` is greedy (0), unset ``top_p`` 1 and ``top_k`` 0 (off),
    as the reference serving system's thinker; an unset ``seed`` of a sampled request is
    drawn at random (a greedy request uses 0: it reads no random numbers).

    Raises:
        RequestValidationError: video content (``messages.<i>.content.<j>``: its frames
            are not decoded in the decoder pool yet; the framework refuses it first, from
            the capabilities), or an audio shorter than one mel frame.
    """
    messages = tuple(ChatMessage(turn.role, tuple(_part(p) for p in turn.parts)) for turn in turns)
    temperature = 0.0 if req.temperature is None else req.temperature
    seed = req.seed if req.seed is not None else (secrets.randbelow(_SEED_MAX + 1) if temperature > 0 else 0)
    sampling = OmniSampling(
        temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0, seed=seed,
    )  # fmt: skip
    frames = (
        DEFAULT_MAX_AUDIO_FRAMES
        if req.max_audio_seconds is None
        else max(1, math.ceil(req.max_audio_seconds * FRAMES_PER_SECOND))
    )
    speaker = req.audio.voice.lower() if req.audio is not None else speakers[0]
    return Qwen3OmniRequest(
        messages, req.audio_output, speaker, sampling,
        max_tokens=req.completion_cap or default_max_tokens, max_audio_frames=frames, stream=req.stream,
        talker_sampling=talker_sampling_of(sampling),
    )  # fmt: skip


def talker_sampling_of(sampling: OmniSampling) -> TalkerSampling:
    """A chat request's talker sampling: code 0 takes the client's temperature, top_k and
    top_p over the reference's rules (repetition penalty 1.05); the code predictor stays
    greedy (transformers' default)."""
    return TalkerSampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


def _part(part: ChatContent) -> ChatPart:
    if isinstance(part, ChatText):
        return ChatPart("text", text=part.text, param=part.param)
    if isinstance(part, ChatAudio):
        samples = resample(part.samples, part.sample_rate, SAMPLE_RATE)
        if len(samples) < SAMPLE_RATE // 100:
            raise RequestValidationError(f"{part.param}: audio shorter than 10 ms", param=part.param)
        return ChatPart("audio", audio=samples, param=part.param)
    if isinstance(part, ChatImage):
        return ChatPart("image", image=Image.fromarray(part.rgb, "RGB"), param=part.param)
    raise RequestValidationError(
        f"{part.param}: the Qwen3-Omni pipeline does not take video content yet", param=part.param
    )
