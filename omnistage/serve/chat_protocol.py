"""OpenAI chat completions wire models (``POST /v1/chat/completions``) and the pure checks
on them.

Request flow::

    req = parse_chat_request(raw_body, model.chat_request)  # JSON, types, ranges, unknown fields
    req = validate_chat_request(req, caps)                    # what the served model accepts
    inputs = load_chat_inputs(req, caps, media_policy)        # media decoded (serve/chat_media.py)
    model_request = model.build_request(req, inputs)

All of them raise :class:`~omnistage.core.errors.RequestValidationError` (400) or
:class:`~omnistage.core.errors.PayloadTooLargeError` (413) whose ``param`` names the field
(``messages.0.content.1.image_url.url``, ``audio.voice``), before any model work.

The schema is OpenAI's (the ``openai`` SDK's ``ChatCompletionCreateParams``) for what it
serves, composed with a model's own fields: a chat model's ``EntryClass.chat_request`` is
:class:`ChatCompletionRequest` or a subclass adding fields; a field no class declares is a
400 listing the model's own fields (an OpenAI field this server does not serve, such as
``tools``, a 400 saying so: :data:`UNSERVED_OPENAI_FIELDS`). Which optional fields a model takes is
``ChatCapabilities.supported_fields``.

Content parts (``messages[i].content`` is a string or a list of parts):

- ``{"type": "text", "text": ...}``;
- ``{"type": "image_url", "image_url": {"url": ...}}``: a ``data:image/...;base64,`` URI,
  or an http(s) URL under the server's media policy (``--allowed-media-domain``);
- ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav" | "mp3" |
  ...}}`` (OpenAI's shape; the data is the whole file in standard base64, in the container
  ``format`` names: :data:`INPUT_AUDIO_FORMATS`);
- ``{"type": "video_url", "video_url": {"url": ...}}``: vLLM's and SGLang's shape for a
  video (OpenAI has none); a ``data:video/...;base64,`` URI or an allowed http(s) URL.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from omnistage.core.errors import RequestValidationError
from omnistage.serve.protocol import TopK, _decode_json_object, check_text, choice

ChatAudioFormat = Literal["wav", "mp3", "flac", "opus", "aac", "pcm16"]
CHAT_AUDIO_FORMATS: frozenset[str] = frozenset(get_args(ChatAudioFormat))
Modality = Literal["text", "audio"]
InputModality = Literal["text", "image", "audio", "video"]
#: ``response_format`` spelling of :mod:`omnistage.serve.audio` for each chat audio format.
ENCODER_FORMAT: Mapping[str, str] = {"pcm16": "pcm", **{f: f for f in CHAT_AUDIO_FORMATS - {"pcm16"}}}
#: OpenAI's ``pcm16`` is 24 kHz signed 16-bit little-endian mono.
PCM16_SAMPLE_RATE = 24_000

#: ``input_audio.format`` values, each with the FFmpeg demuxers (``av`` container format
#: names) that read its files: OpenAI's two, ``"wav"`` and ``"mp3"`` (the openai SDK's
#: ``InputAudio.format``, ``Literal["wav", "mp3"]``), and the common formats of the playground's
#: file picker (it sends the file's extension). Another value is a 400 naming the field; a
#: file in another container than its format's too (strict: a declared format is checked,
#: never ignored).
INPUT_AUDIO_FORMATS: Mapping[str, frozenset[str]] = {
    "wav": frozenset({"wav"}),
    "mp3": frozenset({"mp3"}),
    "flac": frozenset({"flac"}),
    "ogg": frozenset({"ogg"}),
    "opus": frozenset({"ogg", "matroska,webm"}),  # a codec: Ogg Opus or WebM Opus files
    "webm": frozenset({"matroska,webm"}),
    "m4a": frozenset({"mov,mp4,m4a,3gp,3g2,mj2"}),
    "mp4": frozenset({"mov,mp4,m4a,3gp,3g2,mj2"}),
    "aac": frozenset({"aac", "mov,mp4,m4a,3gp,3g2,mj2"}),  # a codec: ADTS or MP4 files
}

_INT32_MAX = 2**31 - 1
_INT63_MAX = 2**63 - 1


# --------------------------------------------------------------------------- request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = Field(default=None, description="accepted, not used")


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Strict):
    data: str = Field(description="the whole audio file, standard base64")
    format: str = Field(description='its container: "wav" or "mp3" (OpenAI\'s), "flac", "ogg", "opus", "webm", "m4a", "mp4" or "aac"')


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoURL(_Strict):
    url: str


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]
PART_TYPES = ("text", "image_url", "input_audio", "video_url")


class ChatMessageIn(_Strict):
    """One message. ``developer`` is OpenAI's newer name for ``system`` and is read as it.
    ``content``: a string or a list of parts (a string is one text part); ``null`` only in
    an assistant message (OpenAI's schema allows it there, e.g. a turn that called tools),
    read as no text. The assistant-message fields OpenAI's SDK may echo back from a reply
    (``refusal``, ``audio``, ``tool_calls``, ``function_call``) are accepted only empty, as
    this server makes no refusals, keeps no reply audio and calls no tools
    (:func:`validate_chat_request` refuses another value, naming it), except ``audio`` beside
    text ``content``: a spoken reply echoed back whole (its ``content`` is its transcript),
    read as that text, as the model reads every past turn."""

    role: Literal["system", "developer", "user", "assistant"]
    content: list[ContentPart]
    name: str | None = Field(default=None, description="accepted, not used")
    refusal: str | None = None
    audio: dict[str, JsonValue] | None = None
    tool_calls: list[JsonValue] | None = None
    function_call: dict[str, JsonValue] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if value is None:
            role = info.data.get("role")
            if role == "assistant":
                return []
            raise PydanticCustomError(
                "null_content", "a {role} message needs content (null is allowed only for the assistant's)",
                {"role": role or "non-assistant"},
            )
        return value

    @property
    def turn_role(self) -> Literal["system", "user", "assistant"]:
        return "system" if self.role == "developer" else self.role


class AudioOutput(_Strict):
    """``audio``: the reply's voice and format (``modalities`` must hold ``"audio"``)."""

    voice: str
    format: ChatAudioFormat


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` (a last chunk with the usage);
    ``include_obfuscation`` false or null only (no chunk carries OpenAI's padding)."""

    include_usage: bool = False
    include_obfuscation: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: OpenAI's three kinds; only ``text`` (the default) is served."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, JsonValue] | None = None


#: ``service_tier`` values (OpenAI's); ``auto`` and ``default`` are the one tier served.
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
_NULL_IS_DEFAULT = ("stream", "n")


class ChatCompletionRequest(_Strict):
    """Body of ``POST /v1/chat/completions``: OpenAI's fields this server serves, and the
    framework's ``top_k``; a model's subclass adds its own (module docstring). Unknown
    fields are rejected. Unset sampling fields take the model's defaults.

    OpenAI's fields clients send at their defaults are accepted at those values only
    (``n`` 1; ``frequency_penalty`` and ``presence_penalty`` 0, as the engine's sampler has
    only a multiplicative repetition penalty; ``logit_bias`` {}; ``logprobs`` false;
    ``top_logprobs`` 0; ``response_format`` ``{"type": "text"}``; ``store`` false;
    ``service_tier`` ``"auto"`` or ``"default"``; ``parallel_tool_calls`` any: there are no
    tools), ``null`` for each meaning its default; another value is a 400 naming the field
    and saying why. ``metadata`` (at most :data:`MAX_METADATA_PAIRS` string pairs, keys of
    at most :data:`MAX_METADATA_KEY_CHARS` characters, values of at most
    :data:`MAX_METADATA_VALUE_CHARS`) and ``user`` are informational: accepted, not used.

    ``max_completion_tokens`` is OpenAI's current name of ``max_tokens``; either may be
    set (both: they must agree). ``stop``: a string or a list of at most
    :data:`MAX_STOP_STRINGS`, each non-empty and at most :data:`MAX_STOP_CHARS` characters
    (an empty list: none); the reply ends before
    the first occurrence of any of them and does not contain it (finish_reason ``"stop"``),
    for a model that declares ``stop`` in its ``supported_fields``.
    """

    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    modalities: list[Modality] | None = Field(
        default=None, description='["text"] or ["text", "audio"]; null: ["text"]'
    )
    audio: AudioOutput | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: TopK = Field(default=None, ge=-1, le=_INT32_MAX, description="0 or -1 = disabled")
    max_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    seed: int | None = Field(default=None, ge=0, le=_INT63_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, description="1 only: one choice per request")
    # OpenAI's fields accepted only at their no-effect values (:func:`_check_no_effect_fields`).
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="0 only")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="0 only")
    logit_bias: dict[str, int] | None = Field(default=None, description="{} only")
    logprobs: bool | None = Field(default=None, description="false only")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="0 only")
    response_format: ResponseFormat | None = Field(default=None, description='{"type": "text"} only')
    store: bool | None = Field(default=None, description="false only: nothing is stored")
    service_tier: ServiceTier | None = Field(default=None, description='"auto" or "default" only')
    parallel_tool_calls: bool | None = Field(default=None, description="accepted, no effect: no tools")
    # informational: accepted (metadata checked against OpenAI's limits), not used
    metadata: dict[str, str] | None = Field(default=None, description="at most 16 string pairs, accepted, not used")
    user: str | None = Field(default=None, description="accepted, not used")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: object) -> object:
        """OpenAI's schema allows ``null`` for ``stream`` and ``n``: their defaults."""
        if isinstance(data, Mapping) and any(data.get(k, 0) is None for k in _NULL_IS_DEFAULT):
            return {k: v for k, v in data.items() if not (k in _NULL_IS_DEFAULT and v is None)}
        return data

    @property
    def audio_output(self) -> bool:
        """The reply is spoken too (``modalities`` holds ``"audio"``)."""
        return "audio" in (self.modalities or ())

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def completion_cap(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: the model's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def own_chat_fields(request_type: type[ChatCompletionRequest]) -> tuple[str, ...]:
    """The fields ``request_type`` adds to :class:`ChatCompletionRequest`."""
    return tuple(name for name in request_type.model_fields if name not in ChatCompletionRequest.model_fields)


#: Optional fields a model must declare in ``supported_fields`` to accept them.
OPTIONAL_CHAT_FIELDS: frozenset[str] = frozenset({"top_k", "seed", "stop"})
#: OpenAI fields this server does not serve, with why: a 400 naming the field says so
#: (a model's subclass may declare one and serve it).
UNSERVED_OPENAI_FIELDS: Mapping[str, str] = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "the model has no reasoning-effort setting",
    "verbosity": "the model has no verbosity setting",
}
#: ``metadata`` limits (OpenAI's): pairs, key characters, value characters.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
#: ``stop`` holds this many strings at most (OpenAI's limit).
MAX_STOP_STRINGS = 4
#: A stop string holds this many characters at most (ours, not OpenAI's: the text held back
#: while it could still begin a stop is decoded again at every token, so its length bounds
#: that cost per step).
MAX_STOP_CHARS = 512


# --------------------------------------------------------------------------- capabilities


class ChatCapabilities(BaseModel):
    """What a served chat model accepts; immutable.

    Attributes:
        model_names: names it is served under (the first is its id in ``/v1/models``).
        model_type: model family, e.g. ``"qwen3_omni"``.
        input_modalities: content part kinds the pipeline takes (``text`` always).
        audio_output: the model can speak (it has a talker); without it a request for
            audio is a 400.
        voices: speaker names (empty when ``audio_output`` is off); matched case-insensitively.
        audio_formats: ``audio.format`` values of a whole (non-streamed) reply.
        stream_audio_formats: ``audio.format`` values of a streamed reply (its deltas,
            concatenated, are a file of that format; OpenAI streams ``pcm16``).
        sample_rate: Hz of the model's audio (``pcm16`` is sent at 24 kHz, resampled).
        supported_fields: optional fields it takes (:data:`OPTIONAL_CHAT_FIELDS` and its
            own fields).
        max_tokens_limit: the highest ``max_tokens``; default_max_tokens: when unset.
        max_images / max_audios / max_videos: media items per request at most.
        max_audio_seconds: duration of one input audio at most, seconds.
        max_video_seconds: duration of one input video at most, seconds.
        max_text_chars: characters of all text parts together at most.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_names: tuple[str, ...] = Field(min_length=1)
    model_type: str
    input_modalities: frozenset[InputModality] = frozenset({"text"})
    audio_output: bool = False
    voices: tuple[str, ...] = ()
    audio_formats: frozenset[ChatAudioFormat] = CHAT_AUDIO_FORMATS
    stream_audio_formats: frozenset[ChatAudioFormat] = frozenset({"pcm16"})
    sample_rate: int = Field(default=PCM16_SAMPLE_RATE, gt=0)
    supported_fields: frozenset[str] = frozenset()
    max_tokens_limit: int = Field(default=4096, ge=1)
    default_max_tokens: int = Field(default=1024, ge=1)
    max_images: int = Field(default=8, ge=0)
    max_audios: int = Field(default=4, ge=0)
    max_videos: int = Field(default=1, ge=0)
    max_audio_seconds: float = Field(default=60.0, gt=0)
    max_video_seconds: float = Field(default=60.0, gt=0)
    max_text_chars: int = Field(default=32_768, ge=1)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @model_validator(mode="after")
    def _consistent(self) -> ChatCapabilities:
        if self.audio_output and not self.voices:
            raise ValueError("a model with audio_output declares its voices")
        if not self.audio_output and self.voices:
            raise ValueError("voices are declared but audio_output is off")
        if "text" not in self.input_modalities:
            raise ValueError("input_modalities must include text")
        if not self.stream_audio_formats <= self.audio_formats:
            raise ValueError("stream_audio_formats must be a subset of audio_formats")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens exceeds max_tokens_limit")
        return self


def check_chat_capabilities(caps: ChatCapabilities, request_type: type[ChatCompletionRequest]) -> None:
    """Raises: ValueError: ``caps`` declares a field that is neither optional nor one of
    ``request_type``'s own."""
    allowed = OPTIONAL_CHAT_FIELDS | set(own_chat_fields(request_type))
    unknown = caps.supported_fields - allowed
    if unknown:
        raise ValueError(f"supported_fields has {sorted(unknown)}, not fields of {request_type.__name__}")


# --------------------------------------------------------------------------- parsing


def parse_chat_request(
    body: bytes | str | Mapping[str, JsonValue], request_type: type[ChatCompletionRequest] = ChatCompletionRequest
) -> ChatCompletionRequest:
    """Parse a chat request body (JSON bytes/str or a decoded mapping) with ``request_type``.

    Raises:
        RequestValidationError: not a JSON object, an unknown field (``param`` = it; the
            message lists the model's own fields), a field of :data:`UNSERVED_OPENAI_FIELDS`
            that is not null (the message says why), or a bad type or value (``param`` = its
            dotted location, e.g. ``messages.0.content.1.image_url.url``).
    """
    data = _decode_json_object(body)
    unserved = {key for key in data if key in UNSERVED_OPENAI_FIELDS and key not in request_type.model_fields}
    for key in sorted(unserved):
        if data[key] is not None:  # null: not set
            raise RequestValidationError(f"{key}: {UNSERVED_OPENAI_FIELDS[key]}", param=key)
    data = {key: value for key, value in data.items() if key not in unserved}
    for key in data:
        if key not in request_type.model_fields:
            own = own_chat_fields(request_type)
            hint = f" (this model's own fields: {', '.join(own)})" if own else ""
            raise RequestValidationError(f"unknown field {str(key)!r}{hint}", param=str(key))
    try:
        return request_type.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> RequestValidationError:
    """The first error, located by field names and indexes: the union and discriminator
    segments pydantic inserts (``str``, ``list[...]``, the part's type tag) are dropped."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    loc: list[str] = []
    raw = list(first["loc"])
    for i, part in enumerate(raw):
        if isinstance(part, str) and ("[" in part or part in ("str", "list")):
            continue
        previous = raw[i - 1] if i else None
        if part in PART_TYPES and isinstance(previous, int) and i >= 2 and raw[i - 2] == "content":
            continue  # the discriminator's tag segment
        loc.append(str(part))
    param = ".".join(loc) or None
    if first["type"] == "union_tag_invalid":
        msg = f"unknown content part type; the types are: {', '.join(PART_TYPES)}"
    else:
        msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    return RequestValidationError(f"{param}: {msg}" if param else msg, param=param)


# --------------------------------------------------------------------------- validation


def validate_chat_request(req: ChatCompletionRequest, caps: ChatCapabilities) -> ChatCompletionRequest:
    """Check ``req`` against what the served model accepts. Pure: no I/O.

    Returns:
        ``req`` with ``audio.voice`` in the spelling ``caps`` declares.

    Raises:
        RequestValidationError: naming the field, when: ``model`` is not served here;
            ``modalities`` is not ``["text"]`` or ``["text", "audio"]``; audio is asked
            of a model without ``audio_output`` (``modalities``, for the ``audio`` field
            too), without ``audio``, or
            ``audio`` is given without it; the voice or format is not available (the
            message lists them); an optional field is not supported; ``max_tokens`` and
            ``max_completion_tokens`` disagree or exceed the limit; ``stop`` holds more than
            :data:`MAX_STOP_STRINGS` strings, an empty one or one over
            :data:`MAX_STOP_CHARS` characters; a content kind is not
            among ``input_modalities``, or there are more media items than allowed; the
            text is too long; the last message is the assistant's; ``stream_options`` is
            set on a request that does not stream (OpenAI refuses it too); an OpenAI field
            is set to a value this server cannot honour (``n`` > 1, a non-zero penalty, a
            non-empty ``logit_bias``, ``logprobs``, ``top_logprobs`` > 0, ``store``,
            ``stream_options.include_obfuscation``, a JSON
            ``response_format`` (``response_format.type``), a ``service_tier`` other than
            auto/default) or a message echoes a ``refusal``, ``audio`` (without text
            ``content``), ``tool_calls`` or
            ``function_call`` (``messages.<i>.<field>``); ``metadata`` is over OpenAI's
            limits (``metadata``, or ``metadata.<key>`` for a long value).
    """
    if req.model and req.model not in caps.model_names:
        raise RequestValidationError(
            f"model {req.model!r} is not served here; available models: {', '.join(caps.model_names)}",
            param="model",
        )
    if req.stream_options is not None and not req.stream:
        raise RequestValidationError("stream_options is only allowed with stream: true", param="stream_options")
    _check_modalities(req, caps)
    _check_no_effect_fields(req)
    _check_optional_fields(req, caps)
    _check_limits(req, caps)
    _check_content(req, caps)
    if req.audio is not None:
        voice = choice("audio.voice", req.audio.voice, caps.voices, ignore_case=True, plural="voices")
        if voice != req.audio.voice:
            req = req.model_copy(update={"audio": req.audio.model_copy(update={"voice": voice})})
    return req


def _check_modalities(req: ChatCompletionRequest, caps: ChatCapabilities) -> None:
    modalities = req.modalities or ["text"]
    if modalities not in (["text"], ["text", "audio"], ["audio", "text"]):
        raise RequestValidationError(
            'modalities must be ["text"] or ["text", "audio"]', param="modalities"
        )
    if (req.audio_output or req.audio is not None) and not caps.audio_output:
        raise RequestValidationError(
            f"model {caps.model_name!r} does not speak: it has no audio output; ask for "
            'modalities ["text"]',
            param="modalities",
        )
    if req.audio_output and req.audio is None:
        raise RequestValidationError(
            'modalities ["text", "audio"] needs audio: {"voice": ..., "format": ...}', param="audio"
        )
    if req.audio is not None and not req.audio_output:
        raise RequestValidationError('audio is given but modalities does not hold "audio"', param="audio")
    if req.audio is None:
        return
    allowed = caps.stream_audio_formats if req.stream else caps.audio_formats
    if req.audio.format not in allowed:
        mode = "streamed" if req.stream else "whole"
        raise RequestValidationError(
            f"audio.format {req.audio.format!r} is not available for a {mode} reply; "
            f"available: {', '.join(sorted(allowed))}",
            param="audio.format",
        )


def _check_no_effect_fields(req: ChatCompletionRequest) -> None:
    """OpenAI's fields that clients send at their defaults: any other value is refused,
    saying why, never ignored; ``metadata`` within OpenAI's limits."""
    refusals = (
        ("n", req.n > 1, "one choice per request is served; n must be 1"),
        ("frequency_penalty", bool(req.frequency_penalty), _NO_PENALTY),
        ("presence_penalty", bool(req.presence_penalty), _NO_PENALTY),
        ("logit_bias", bool(req.logit_bias), "logit bias is not supported; send {} or omit it"),
        ("logprobs", bool(req.logprobs), "log probabilities are not returned; logprobs must be false"),
        ("top_logprobs", bool(req.top_logprobs), "log probabilities are not returned; top_logprobs must be 0"),
        ("store", bool(req.store), "completions are not stored; store must be false"),
        ("stream_options.include_obfuscation", bool(req.stream_options and req.stream_options.include_obfuscation),
         "stream chunks are not padded; include_obfuscation must be false"),
        ("service_tier", req.service_tier not in (None, "auto", "default"),
         'one processing tier is served; service_tier must be "auto" or "default"'),
        ("response_format.type", req.response_format is not None and req.response_format.type != "text",
         'structured output is not supported; response_format must be {"type": "text"}'),
    )  # fmt: skip
    for param, refused, why in refusals:
        if refused:
            raise RequestValidationError(f"{param}: {why}", param=param)
    for m, message in enumerate(req.messages):
        _check_message_echoes(message, f"messages.{m}")
    _check_metadata(req.metadata or {})


_NO_PENALTY = "the sampler has no presence or frequency penalty; it must be 0"


def _check_message_echoes(message: ChatMessageIn, where: str) -> None:
    echoes = (
        ("refusal", message.refusal is not None, "refusals are not taken; send the text as content"),
        ("audio", message.audio is not None and not any(part.type == "text" and part.text for part in message.content),
         "a reply's audio is not kept, so it cannot be referred to by id; send its transcript as content"),
        ("tool_calls", bool(message.tool_calls), "tool calling is not supported"),
        ("function_call", message.function_call is not None, "function calling is not supported"),
    )  # fmt: skip
    for name, refused, why in echoes:
        if refused:
            raise RequestValidationError(f"{where}.{name}: {why}", param=f"{where}.{name}")


def _check_metadata(metadata: Mapping[str, str]) -> None:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise RequestValidationError(
            f"metadata holds {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise RequestValidationError(
                f"metadata: a key holds {len(key)} characters; at most {MAX_METADATA_KEY_CHARS}", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise RequestValidationError(
                f"metadata.{key} holds {len(value)} characters; at most {MAX_METADATA_VALUE_CHARS}",
                param=f"metadata.{key}",
            )


def _check_optional_fields(req: ChatCompletionRequest, caps: ChatCapabilities) -> None:
    optional = OPTIONAL_CHAT_FIELDS | set(own_chat_fields(type(req)))
    for name in sorted(optional):
        info = type(req).model_fields[name]
        value = getattr(req, name)
        if value is None or value == info.get_default(call_default_factory=True):
            continue
        if name not in caps.supported_fields:
            raise RequestValidationError(
                f"field {name!r} is not supported by model {caps.model_name!r}; its optional "
                f"fields: {', '.join(sorted(caps.supported_fields)) or 'none'}",
                param=name,
            )


def _check_limits(req: ChatCompletionRequest, caps: ChatCapabilities) -> None:
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise RequestValidationError(
            "max_tokens and max_completion_tokens are both set, differently; set one",
            param="max_completion_tokens",
        )
    cap = req.completion_cap
    if cap is not None and cap > caps.max_tokens_limit:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise RequestValidationError(f"{name} {cap} exceeds this model's limit of {caps.max_tokens_limit}", param=name)
    stops = req.stop_sequences
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestValidationError(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    for i, stop in enumerate(stops):
        if not stop:
            where = "stop" if isinstance(req.stop, str) else f"stop.{i}"
            raise RequestValidationError(f"{where}: a stop string must not be empty", param=where)
        if len(stop) > MAX_STOP_CHARS:
            where = "stop" if isinstance(req.stop, str) else f"stop.{i}"
            raise RequestValidationError(
                f"{where}: a stop string holds {len(stop)} characters; at most {MAX_STOP_CHARS}", param=where
            )


_KIND = {"text": "text", "image_url": "image", "input_audio": "audio", "video_url": "video"}


def _check_content(req: ChatCompletionRequest, caps: ChatCapabilities) -> None:
    counts = {"image": 0, "audio": 0, "video": 0}
    limits = {"image": caps.max_images, "audio": caps.max_audios, "video": caps.max_videos}
    chars = 0
    for m, message in enumerate(req.messages):
        if message.turn_role != "user" and any(part.type != "text" for part in message.content):
            raise RequestValidationError(
                f"messages.{m}: only user messages may hold media", param=f"messages.{m}.content"
            )
        for p, part in enumerate(message.content):
            param = f"messages.{m}.content.{p}"
            kind = _KIND[part.type]
            if kind not in caps.input_modalities:
                raise RequestValidationError(
                    f"{param}: model {caps.model_name!r} does not take {kind} input; it takes: "
                    f"{', '.join(sorted(caps.input_modalities))}",
                    param=param,
                )
            if kind == "text":
                check_text(f"{param}.text", part.text, caps.max_text_chars)
                chars += len(part.text)
                continue
            if kind == "audio" and part.input_audio.format not in INPUT_AUDIO_FORMATS:
                raise RequestValidationError(
                    f"{param}.input_audio.format {part.input_audio.format!r} is not an audio format "
                    f"this server reads; use {' or '.join(repr(f) for f in INPUT_AUDIO_FORMATS)} "
                    "(OpenAI takes 'wav' and 'mp3')",
                    param=f"{param}.input_audio.format",
                )
            counts[kind] += 1
            if counts[kind] > limits[kind]:
                raise RequestValidationError(
                    f"{param}: more than {limits[kind]} {kind} item(s) in one request", param=param
                )
    if chars > caps.max_text_chars:
        raise RequestValidationError(
            f"messages hold {chars} characters of text; the maximum is {caps.max_text_chars}",
            param="messages",
        )
    if req.messages[-1].turn_role == "assistant":
        raise RequestValidationError(
            "the last message is the assistant's; continuing a reply is not supported",
            param=f"messages.{len(req.messages) - 1}.role",
        )


# --------------------------------------------------------------------------- responses


class ReplyAudio(BaseModel):
    """``message.audio`` of a whole reply: ``data`` is the whole file (base64) of the
    requested format; ``transcript`` the reply text; ``expires_at`` Unix s (the audio is
    not kept: the id cannot be sent back in a later turn)."""

    id: str
    data: str
    expires_at: int
    transcript: str


class ReplyMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    audio: ReplyAudio | None = None


class Choice(BaseModel):
    index: int = 0
    message: ReplyMessage
    finish_reason: str
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    text_tokens: int = 0
    audio_tokens: int = 0
    image_tokens: int = 0
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """``audio_tokens``: the audio frames the model generated (its codec frames)."""

    text_tokens: int = 0
    audio_tokens: int = 0
    reasoning_tokens: int = 0


class ChatUsage(BaseModel):
    """``completion_tokens`` counts text and audio tokens (OpenAI's convention)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage


class DeltaAudio(BaseModel):
    """``delta.audio``: ``data`` the next bytes of the format (base64); the last audio
    delta has ``expires_at`` and the whole reply's ``transcript`` (the text itself streams
    in ``delta.content``)."""

    id: str
    data: str | None = None
    transcript: str | None = None
    expires_at: int | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: DeltaAudio | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None


def sse_data(obj: BaseModel | Mapping[str, JsonValue]) -> bytes:
    """One OpenAI stream event: ``b"data: <compact json>\\n\\n"`` (None fields dropped)."""
    if isinstance(obj, BaseModel):
        text = obj.model_dump_json(exclude_none=True)
    else:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


class ChatVoicesResponse(BaseModel):
    """``GET /v1/audio/voices`` of a chat model: its speakers and reply formats."""

    model: str
    model_type: str
    voices: list[str]
    audio_output: bool
    audio_formats: list[str]
    stream_audio_formats: list[str]
    sample_rate: int = Field(description="Hz")
    input_modalities: list[str]
    supported_fields: list[str]
    fields: dict[str, dict[str, JsonValue]]


def chat_voices_response(caps: ChatCapabilities, request_type: type[ChatCompletionRequest]) -> ChatVoicesResponse:
    schema = request_type.model_json_schema()
    return ChatVoicesResponse(
        model=caps.model_name,
        model_type=caps.model_type,
        voices=list(caps.voices),
        audio_output=caps.audio_output,
        audio_formats=sorted(caps.audio_formats) if caps.audio_output else [],
        stream_audio_formats=sorted(caps.stream_audio_formats) if caps.audio_output else [],
        sample_rate=caps.sample_rate,
        input_modalities=sorted(caps.input_modalities),
        supported_fields=sorted(caps.supported_fields),
        fields={name: prop for name, prop in schema["properties"].items() if name in caps.supported_fields},
    )
