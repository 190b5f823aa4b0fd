"""The Qwen3-Omni chat request: its ``/v1/chat/completions`` schema and the builder of the
pipeline's :class:`~.payload_types.Qwen3OmniRequest` from a validated request whose media
the framework decoded (:mod:`omnistage.serve.chat_media`)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch
from PIL import Image
from pydantic import Field

from omnistage.core.errors import RequestValidationError
from omnistage.models.qwen3_omni.modeling.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.modeling.prompt import talker_prompt_length
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest, TalkerSampling
from omnistage.models.qwen3_omni.processing import (
    SAMPLE_RATE,
    ChatMessage,
    ChatPart,
    Qwen3OmniProcessor,
    decode_video,
)
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
    ``top_k``, with ``seed`` in the sampler's range, plus its own ``max_audio_seconds`` and
    ``use_audio_in_video``."""

    seed: int | None = Field(default=None, ge=0, le=_SEED_MAX, description="sampler seed (0..2**31-1)")
    max_audio_seconds: float | None = Field(
        default=None, gt=0.0, le=DEFAULT_MAX_AUDIO_FRAMES / FRAMES_PER_SECOND,
        description="speech of the reply at most, seconds (12.5 talker frames per second)",
    )  # fmt: skip
    use_audio_in_video: bool = Field(
        default=False, description="every video's audio track is in the prompt too (interleaved by time)"
    )


@dataclass(frozen=True)
class ChatLimits:
    """What one request may ask of the pipeline, checked before any model work.

    Attributes:
        default_max_tokens: the reply cap of a request that sets none.
        thinker_max_model_len: the thinker stage's ``max_model_len`` (prompt + reply tokens).
        talker_max_model_len: the talker stage's (its prompt + speech frames); 0 in a
            pipeline without a talker stage (the text variant: no request speaks).
    """

    default_max_tokens: int
    thinker_max_model_len: int
    talker_max_model_len: int


def build_chat_request(
    req: Qwen3OmniChatRequest,
    turns: tuple[ChatTurn, ...],
    processor: Qwen3OmniProcessor,
    config: Qwen3OmniConfig,
    limits: ChatLimits,
) -> Qwen3OmniRequest:
    """The pipeline's request: the turns' text, audio (resampled to the feature
    extractor's 16 kHz), images and videos (their frames sampled as the processor's
    :class:`~.processing.VideoSampling` says, in the decoder pool, with their audio track
    when ``use_audio_in_video``) as :class:`ChatMessage` s, the voice (the first of the talker
    config's speakers when the request names none), sampling and caps, checked against the thinker
    and talker stages' ``max_model_len`` as their engines count (:func:`check_lengths`).

    Sampling: unset ``temperature`` is greedy (0), unset ``top_p`` 1 and ``top_k`` 0 (off),
    as the reference serving system's thinker; an unset ``seed`` of a sampled request is
    drawn at random (a greedy request uses 0: it reads no random numbers).

    ``max_audio_seconds`` becomes ``ceil(seconds x 12.5)`` talker frames (a float's
    rounding below a whole frame forgiven: 0.56 s is 7 frames).

    Raises:
        RequestValidationError: an undecodable video (``messages.<i>.content.<j>.video_url.url``),
            one without an audio track when ``use_audio_in_video``, an audio too short for
            the feature extractor, or a request over a stage's ``max_model_len``
            (:func:`check_lengths`).
        PayloadTooLargeError: a video over its frame, duration or pixel cap.
    """
    messages = tuple(
        ChatMessage(turn.role, tuple(_part(p, processor, req.use_audio_in_video) for p in turn.parts)) for turn in turns
    )
    temperature = 0.0 if req.temperature is None else req.temperature
    seed = req.seed if req.seed is not None else (secrets.randbelow(_SEED_MAX + 1) if temperature > 0 else 0)
    sampling = OmniSampling(
        temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0, seed=seed,
    )  # fmt: skip
    frames = (
        DEFAULT_MAX_AUDIO_FRAMES
        if req.max_audio_seconds is None
        else max(1, math.ceil(req.max_audio_seconds * FRAMES_PER_SECOND - 1e-6))
    )
    max_tokens = req.completion_cap or limits.default_max_tokens
    prompt_ids = processor.prompt_ids(messages)
    check_lengths(req, prompt_ids, max_tokens, frames, config, limits)
    audio_tokens, image_tokens = processor.media_positions(prompt_ids)
    # a reply not spoken names no voice; the text variant may serve a checkpoint without a talker
    speakers = config.talker.speaker_id if config.talker is not None else {}
    voice = req.audio.voice.lower() if req.audio is not None else next(iter(speakers), "")
    return Qwen3OmniRequest(
        messages, req.audio_output, voice, sampling,
        max_tokens=max_tokens, max_audio_frames=frames, stream=req.stream,
        talker_sampling=talker_sampling_of(sampling),
        prompt_audio_tokens=audio_tokens, prompt_image_tokens=image_tokens, stop=req.stop_sequences,
    )  # fmt: skip


def check_lengths(
    req: Qwen3OmniChatRequest, prompt_ids: list[int], max_tokens: int, frames: int,
    config: Qwen3OmniConfig, limits: ChatLimits,
) -> None:
    """Refuse a request the thinker or talker engine could not take: the thinker prompt
    (``prompt_ids``, media placeholders expanded) + ``max_tokens`` over the thinker stage's
    ``max_model_len``, or for a spoken reply the talker's prompt
    (:func:`~.modeling.prompt.talker_prompt_length`) + ``frames`` over the talker stage's:
    what each engine checks when the request reaches it, decided here before any model work.

    Raises:
        RequestValidationError: on ``max_tokens`` (``max_completion_tokens`` when that is
            what the request set) or ``max_audio_seconds`` when a smaller value fits (the
            message says the most that does), else on ``messages`` (the prompt alone
            leaves no room).
    """  # fmt: skip
    prompt, limit = len(prompt_ids), limits.thinker_max_model_len
    if prompt + max_tokens > limit:
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = f"{field} {max_tokens}" if req.completion_cap is not None else f"the default max_tokens {max_tokens}"
        where = f"the prompt takes {prompt} positions (media placeholders included), and prompt + reply are at most {limit} (the thinker stage's max_model_len)"
        if prompt < limit:
            raise RequestValidationError(f"{asked} is too many for this prompt: {where}; ask for at most {limit - prompt}", param=field)
        raise RequestValidationError(f"messages are too long for this server: {where}; shorten them", param="messages")
    if not req.audio_output:
        return
    talker, limit = talker_prompt_length(torch.tensor(prompt_ids), config), limits.talker_max_model_len
    if talker + frames > limit:
        asked = (
            f"max_audio_seconds {req.max_audio_seconds:g} ({frames} frames)" if req.max_audio_seconds is not None
            else f"the default speech cap of {frames} frames (max_audio_seconds unset)"
        )
        where = f"the talker's prompt takes {talker} positions, and prompt + speech frames are at most {limit} (the talker stage's max_model_len)"
        if talker < limit:
            most = limit - talker
            raise RequestValidationError(
                f"{asked} is too long for this prompt: {where}; ask for at most {most} frames "
                f"(max_audio_seconds {most / FRAMES_PER_SECOND:g})", param="max_audio_seconds",
            )
        raise RequestValidationError(f"messages are too long for a spoken reply: {where}; shorten them", param="messages")  # fmt: skip


def talker_sampling_of(sampling: OmniSampling) -> TalkerSampling:
    """A chat request's talker sampling: code 0 takes the client's temperature, top_k and
    top_p over the reference's rules (repetition penalty 1.05); the code predictor stays
    greedy (transformers' default)."""
    return TalkerSampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


def _part(part: ChatContent, processor: Qwen3OmniProcessor, use_audio_in_video: bool) -> ChatPart:
    if isinstance(part, ChatText):
        return ChatPart("text", text=part.text, param=part.param)
    if isinstance(part, ChatAudio):
        samples = resample(part.samples, part.sample_rate, SAMPLE_RATE)  # length: checked by prompt_ids
        return ChatPart("audio", audio=samples, param=part.param)
    if isinstance(part, ChatImage):
        return ChatPart("image", image=Image.fromarray(part.rgb, "RGB"), param=part.param)
    where = f"{part.param}.video_url.url"
    video = decode_video(
        part.data, where, processor.video, with_audio=use_audio_in_video, policy=part.policy,
        max_duration_s=part.max_seconds,
    )  # fmt: skip
    return ChatPart("video", video=video, use_audio=use_audio_in_video, param=where)
