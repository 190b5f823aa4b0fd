"""A chat request's messages with their media decoded: what a chat model's request builder
receives (:meth:`omnistage.serve.model.ChatModelConfig.build_request`).

Every untrusted item is read under the server's media policy (:mod:`omnistage.serve.media`:
size cap, URL and local-file rules) and decoded in the decoder worker pool
(:mod:`omnistage.serve.decoding`: deadline, memory limit, a crash is this request's 400),
never in the server process. Blocks (network, decoding): call it from a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from omnistage.core.errors import RequestValidationError
from omnistage.serve.chat_protocol import (
    INPUT_AUDIO_FORMATS,
    AudioPart,
    ChatCapabilities,
    ChatCompletionRequest,
    ImagePart,
    TextPart,
    VideoPart,
)
from omnistage.serve.media import (
    DeclaredFormat,
    MediaPolicy,
    decode_audio,
    decode_image,
    read_base64_source,
    read_media_url,
    read_media_url_source,
)

__all__ = ["ChatAudio", "ChatContent", "ChatImage", "ChatText", "ChatTurn", "ChatVideo", "load_chat_inputs"]


@dataclass(frozen=True)
class ChatText:
    text: str
    param: str


@dataclass(frozen=True, eq=False)
class ChatImage:
    """``rgb``: ``[H, W, 3]`` uint8."""

    rgb: np.ndarray
    param: str


@dataclass(frozen=True, eq=False)
class ChatAudio:
    """``samples``: mono float32 ``[N]`` in [-1, 1] at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int
    param: str


@dataclass(frozen=True, eq=False)
class ChatVideo:
    """A video file's bytes, read under the media policy and not decoded here: the model's
    request builder samples its frames as its processor needs, in the decoder pool
    (:func:`omnistage.serve.media.decode_video`) under ``policy`` and the model's
    ``max_seconds`` (``ChatCapabilities.max_video_seconds``)."""

    data: bytes
    param: str
    policy: MediaPolicy
    max_seconds: float


ChatContent = ChatText | ChatImage | ChatAudio | ChatVideo


@dataclass(frozen=True)
class ChatTurn:
    """One message: ``role`` (``developer`` read as ``system``) and its decoded parts, in
    order; ``param`` is ``messages.<i>``."""

    role: Literal["system", "user", "assistant"]
    parts: tuple[ChatContent, ...]
    param: str


def load_chat_inputs(
    req: ChatCompletionRequest, caps: ChatCapabilities, policy: MediaPolicy
) -> tuple[ChatTurn, ...]:
    """The messages of a validated request with every media item read and decoded.

    Raises:
        PayloadTooLargeError: an item above the size cap, an audio longer than
            ``caps.max_audio_seconds``, an image above the pixel cap.
        RequestValidationError: malformed base64 or data URI, a URL the policy refuses,
            undecodable media, an audio file in another container than its
            ``input_audio.format``, naming the part (``messages.<i>.content.<j>...``).
    """
    turns = []
    for m, message in enumerate(req.messages):
        parts = tuple(
            _load_part(part, f"messages.{m}.content.{p}", caps, policy) for p, part in enumerate(message.content)
        )
        turns.append(ChatTurn(message.turn_role, parts, f"messages.{m}"))
    return tuple(turns)


def _load_part(
    part: TextPart | ImagePart | AudioPart | VideoPart, param: str, caps: ChatCapabilities, policy: MediaPolicy
) -> ChatContent:
    if isinstance(part, TextPart):
        return ChatText(part.text, param)
    if isinstance(part, ImagePart):
        where = f"{param}.image_url.url"
        source = read_media_url_source(part.image_url.url, policy, where, "image")  # base64 decoded in the worker
        return ChatImage(decode_image(source, policy, where), param)
    if isinstance(part, AudioPart):
        where = f"{param}.input_audio.data"
        if not part.input_audio.data.strip():
            raise RequestValidationError(f"{where} is empty", param=where)
        data = read_base64_source(part.input_audio.data, policy, where)  # decoded in the worker
        name = part.input_audio.format  # one of INPUT_AUDIO_FORMATS (validate_chat_request)
        declared = DeclaredFormat(f"{param}.input_audio.format", name, INPUT_AUDIO_FORMATS[name])
        audio = decode_audio(data, policy, where, max_duration_s=caps.max_audio_seconds, declared=declared)
        return ChatAudio(audio.samples, audio.sample_rate, param)
    where = f"{param}.video_url.url"
    return ChatVideo(read_media_url(part.video_url.url, policy, where, "video"), param, policy, caps.max_video_seconds)
