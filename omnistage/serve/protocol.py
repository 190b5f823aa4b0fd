"""OpenAI-compatible wire models of the HTTP API, and the pure checks on them.

Request flow for ``POST /v1/audio/speech``::

    req = parse_speech_request(raw_body, model.speech_request)  # JSON, types, ranges, unknown fields
    req = validate_speech_request(req, caps)     # semantics: what the served model accepts

Both raise only :class:`~omnistage.core.errors.RequestValidationError` (HTTP 400) whose ``param``
names the offending field; :func:`error_envelope` turns any omnistage error into the OpenAI
error body ``{"error": {"message", "type", "param", "code"}}``.

A model's own fields
--------------------
:class:`SpeechRequest` holds OpenAI's speech fields plus the generation fields the
framework offers every model (``language``, sampling). A model adds its own by subclassing
it (its ``EntryClass.speech_request``, e.g. Piper's ``noise_scale``): pydantic types and
ranges them, :func:`parse_speech_request` parses a body with that class, so a field no
class declares is a 400 listing the model's own fields, and ``/v1/audio/voices`` lists
each accepted field's JSON schema. Which optional fields a checkpoint accepts is
``SpeechCapabilities.supported_fields``.
"""

from __future__ import annotations

import base64
import json
import re
import unicodedata
from collections.abc import Mapping
from typing import Annotated, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    model_validator,
)

from omnistage.core.errors import OmnistageError, PayloadTooLargeError, RequestValidationError
from omnistage.core.payloads import AudioResult
from omnistage.serve.audio import encoded_rate

ResponseFormat = Literal["wav", "pcm", "flac", "mp3", "opus", "aac"]
StreamFormat = Literal["audio", "sse"]
RESPONSE_FORMATS: frozenset[str] = frozenset(get_args(ResponseFormat))

#: Request fields every model accepts; ``supported_fields`` declares the others.
ALWAYS_ALLOWED_FIELDS: frozenset[str] = frozenset(
    {"model", "input", "response_format", "stream", "stream_format", "sample_rate"}
)
#: Fields OpenAI's ``/v1/audio/speech`` defines that a model may have no use for: sent to
#: a model that does not use them they are accepted, dropped, and named in the response's
#: ``X-Ignored-Fields`` header (an OpenAI client sends them without knowing the model).
#: Every other field a model does not declare is a 400.
OPENAI_OPTIONAL_FIELDS: frozenset[str] = frozenset({"voice", "instructions", "speed"})
#: ``pcm`` has no header to carry its rate: OpenAI's is 24 kHz, so it is the default here
#: whatever the model's own rate (the audio is resampled).
OPENAI_PCM_SAMPLE_RATE = 24_000
#: Formats whose output rate a request may choose (``sample_rate``).
RESAMPLABLE_FORMATS: frozenset[str] = frozenset({"pcm", "wav"})
#: Formats whose header states the audio's length. Streamed, that length can only be a
#: placeholder (wav: RIFF and data sizes 0xFFFFFFFF, as OpenAI streams it; flac: total
#: samples 0, "unknown"), and common readers take it at its word: Python's ``wave`` reports
#: 0xFFFFFFFF bytes of frames (27 hours at 22.05 kHz) and soundfile (libsndfile) cannot read
#: a streamed flac at all. So these stream only when the client asks for it; with ``stream``
#: unset they are one whole file with exact sizes.
LENGTH_HEADER_FORMATS: frozenset[str] = frozenset({"wav", "flac"})
#: Wire aliases: alias -> canonical field name.
FIELD_ALIASES: Mapping[str, str] = {"text": "input", "speaker": "voice"}

_INT32_MAX = 2**31 - 1
_INT63_MAX = 2**63 - 1


def _disabled_is_zero(value: int | None) -> int | None:
    return 0 if value == -1 else value


#: A request's ``top_k``: -1 (vLLM's spelling of "off") is stored as 0, the engine's.
TopK = Annotated[int | None, AfterValidator(_disabled_is_zero)]


# --------------------------------------------------------------------------- request


class SpeechRequest(BaseModel):
    """Body of ``POST /v1/audio/speech``: OpenAI's fields and the framework's generation
    fields; a model's subclass adds its own (module docstring). Unknown fields are rejected.

    Types are strict (JSON semantics: an int is accepted for a float, nothing else is
    coerced) and floats must be finite. ``text`` is accepted as an alias of ``input`` and
    ``speaker`` of ``voice``; giving both spellings with different values raises
    :class:`RequestValidationError`. A sampling field left unset (``None``) takes the
    model's default.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    input: str = Field(description="text to speak (alias: text)")
    voice: str | None = Field(
        default=None, description='voice name, or {"id": name} (alias: speaker)'
    )
    response_format: ResponseFormat = "wav"
    speed: float = Field(
        default=1.0, ge=0.25, le=4.0, description="speaking rate: duration scales as 1/speed"
    )
    stream: bool | None = Field(
        default=None,
        description="false: one whole file; true: chunks as they are made; null: stream "
        "whenever the model can stream the format, except wav and flac (whole files, so "
        "their headers carry the exact length)",
    )
    stream_format: StreamFormat = Field(
        default="audio", description='"sse" streams JSON events and implies streaming'
    )
    sample_rate: int | None = Field(
        default=None,
        ge=8_000,
        le=48_000,
        description="Hz of pcm or wav output (resampled); null: 24000 for pcm, the "
        "model's rate for wav",
    )
    language: str | None = None
    instructions: str | None = Field(default=None, description="how to speak (OpenAI)")

    max_new_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, description="0 = greedy")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: TopK = Field(
        default=None, ge=-1, le=_INT32_MAX, description="0 or -1 = disabled (stored as 0)"
    )
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = Field(default=None, ge=0, le=_INT63_MAX)

    ignored_fields: tuple[str, ...] = Field(
        default=(),
        description="OpenAI fields the client set that this model does not use; filled by "
        "validate_speech_request, never sent under this name",
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve_aliases(cls, data: object) -> object:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for key in ("voice", "speaker"):
            if key in data:
                data[key] = _voice_name(data[key])
        for alias, name in FIELD_ALIASES.items():
            if alias not in data:
                continue
            value = data.pop(alias)
            if name in data and data[name] != value:
                raise RequestValidationError(
                    f"'{name}' and its alias '{alias}' are both set with different values; "
                    "set only one",
                    param=name,
                )
            data[name] = value
        return data

    @property
    def streaming(self) -> bool:
        """True when the response is streamed: ``stream`` or ``stream_format == "sse"``
        (:func:`validate_speech_request` resolves an unset ``stream``)."""
        return bool(self.stream) or self.stream_format == "sse"

def _voice_name(value: object) -> object:
    """``voice`` as OpenAI's SDK sends it: a name, or ``{"id": name}`` (its custom-voice
    form) -> the name; anything else is left for the type check (a 400)."""
    if isinstance(value, Mapping):
        if set(value) != {"id"} or not isinstance(value["id"], str):
            raise RequestValidationError(
                'voice must be a string or {"id": "<voice name>"}', param="voice"
            )
        return value["id"]
    return value


_INTERNAL_FIELDS = frozenset({"ignored_fields"})


def wire_fields(request_type: type[SpeechRequest]) -> frozenset[str]:
    """Names a client may send to a model whose schema is ``request_type`` (its fields and
    the aliases)."""
    return (frozenset(request_type.model_fields) - _INTERNAL_FIELDS) | frozenset(FIELD_ALIASES)


def optional_fields(request_type: type[SpeechRequest]) -> frozenset[str]:
    """Fields a model with schema ``request_type`` may list in ``supported_fields``."""
    return frozenset(request_type.model_fields) - ALWAYS_ALLOWED_FIELDS - _INTERNAL_FIELDS


def own_fields(request_type: type[SpeechRequest]) -> tuple[str, ...]:
    """The fields ``request_type`` adds to :class:`SpeechRequest`, in declaration order."""
    return tuple(name for name in request_type.model_fields if name not in SpeechRequest.model_fields)


# --------------------------------------------------------------------------- capabilities


class SpeechCapabilities(BaseModel):
    """What a served speech model accepts; immutable, checked at construction.

    Attributes:
        model_names: names the model is served under; the first is its id in ``/v1/models``.
            A request's ``model`` must be one of them (when given).
        model_type: model family, e.g. ``"qwen3_tts"`` or ``"piper"``.
        supported_fields: request fields accepted beyond :data:`ALWAYS_ALLOWED_FIELDS`:
            fields of the model's schema (:func:`check_capabilities` checks them against
            it). ``voice`` is governed by ``voices`` and ``default_voice`` instead (listing
            it here is allowed and has no effect).
        voices: accepted voice names. Empty: only ``default_voice`` (if any) is accepted.
        default_voice: voice used when the request names none; must be in ``voices`` when
            ``voices`` is non-empty. With voices but no default, a request must name one.
        languages: accepted ``language`` values (include ``"auto"`` where the model detects
            the language); required non-empty when ``language`` is supported.
        sample_rate: output sample rate in Hz (> 0).
        max_input_chars: cap on ``input`` (and ``instructions``) length in characters
            (>= 1).
        speed_range: inclusive ``(min, max)`` speed factor within 0.25..4.0, containing 1.0.
        response_formats: accepted ``response_format`` values (subset of the six).
        stream_response_formats: formats accepted when the request streams.
        saved_voices: the model clones voices from a clip, so it takes voices saved with
            ``POST /v1/audio/voices`` (its config implements ``with_saved_voice``).
        live_text_input: a request's text can continue while it runs (its config
            implements ``build_live_request``): a WebSocket session feeds its text into one
            running request as it arrives, instead of sentence by sentence.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_names: tuple[str, ...] = Field(min_length=1)
    model_type: str
    supported_fields: frozenset[str] = frozenset()
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    languages: tuple[str, ...] = ()
    sample_rate: int = Field(gt=0)
    max_input_chars: int = Field(default=4096, ge=1)
    speed_range: tuple[float, float] = (0.25, 4.0)
    response_formats: frozenset[ResponseFormat] = RESPONSE_FORMATS
    stream_response_formats: frozenset[ResponseFormat] = frozenset({"pcm", "wav"})
    saved_voices: bool = False
    live_text_input: bool = False

    @property
    def model_name(self) -> str:
        """The primary served name (first of ``model_names``)."""
        return self.model_names[0]

    @property
    def accepted_fields(self) -> frozenset[str]:
        """Every request field this model accepts."""
        voice = {"voice"} if self.voices or self.default_voice else set()
        return ALWAYS_ALLOWED_FIELDS | (self.supported_fields - {"voice"}) | voice

    @model_validator(mode="after")
    def _consistent(self) -> SpeechCapabilities:
        _check_caps_choices(self)
        _check_caps_ranges(self)
        return self


def check_capabilities(caps: SpeechCapabilities, request_type: type[SpeechRequest]) -> None:
    """Check that ``caps`` declares only fields of the model's schema ``request_type``.

    Raises:
        ValueError: a supported field is not a field of ``request_type``.
    """
    allowed = optional_fields(request_type)
    unknown = caps.supported_fields - allowed
    if unknown:
        raise ValueError(
            f"supported_fields has fields {sorted(unknown)} that {request_type.__name__} does "
            f"not declare; it declares: {', '.join(sorted(allowed))}"
        )


def _check_caps_choices(caps: SpeechCapabilities) -> None:
    if caps.voices and caps.default_voice is not None and caps.default_voice not in caps.voices:
        raise ValueError(f"default_voice {caps.default_voice!r} is not in voices")
    if "language" in caps.supported_fields and not caps.languages:
        raise ValueError("language is supported but no language values are declared")
    if not caps.stream_response_formats <= caps.response_formats:
        raise ValueError("stream_response_formats must be a subset of response_formats")


def _check_caps_ranges(caps: SpeechCapabilities) -> None:
    low, high = caps.speed_range
    if not 0.25 <= low <= 1.0 <= high <= 4.0:
        raise ValueError(
            f"speed_range {caps.speed_range} must satisfy 0.25 <= min <= 1 <= max <= 4"
        )


# --------------------------------------------------------------------------- parsing


def parse_speech_request(
    body: bytes | str | Mapping[str, JsonValue], request_type: type[SpeechRequest] = SpeechRequest
) -> SpeechRequest:
    """Parse a speech request body (raw JSON bytes/str, or an already decoded mapping) with
    the model's schema ``request_type``.

    Raises:
        RequestValidationError: the body is not a JSON object, has an unknown field
            (``param`` = that field; the message lists the model's own fields), or a field
            has a bad type or value (``param`` = its dotted location, e.g.
            ``references.0.audio``).
    """
    data = _decode_json_object(body)
    _reject_unknown_fields(data, request_type)
    try:
        return request_type.model_validate(data)
    except ValidationError as exc:
        raise request_error_from_validation(exc) from None


def _decode_json_object(body: bytes | str | Mapping[str, JsonValue]) -> dict[str, JsonValue]:
    if isinstance(body, bytes | bytearray | str):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise RequestValidationError(f"request body is not valid JSON: {reason}") from None
    if not isinstance(body, Mapping):
        raise RequestValidationError("request body must be a JSON object")
    return dict(body)


def _reject_unknown_fields(data: Mapping[str, JsonValue], request_type: type[SpeechRequest]) -> None:
    known = wire_fields(request_type)
    for key in data:
        if key in known:
            continue
        own = own_fields(request_type)
        hint = f" (this model's own fields: {', '.join(own)})" if own else ""
        raise RequestValidationError(f"unknown field {str(key)!r}{hint}", param=str(key))


def request_error_from_validation(exc: ValidationError) -> RequestValidationError:
    """Convert a pydantic ``ValidationError`` to a :class:`RequestValidationError` naming
    the first bad field's dotted location (``param``), e.g. ``"speed: Input should be less
    than or equal to 4"``. Input values are never echoed."""
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return RequestValidationError("invalid request")
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    param = ".".join(loc) or None
    msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return RequestValidationError(message, param=param)


# --------------------------------------------------------------------------- validation


def validate_speech_request(req: SpeechRequest, caps: SpeechCapabilities) -> SpeechRequest:
    """Check ``req`` against what the served model accepts. Pure: no I/O; ``req`` itself is
    not changed.

    A field counts as *set* when its value is not ``None``, not its default and not an
    empty list (so ``speed: 1.0`` or a model's ``false`` flag are no-ops anywhere).
    ``voice`` and ``language`` match the declared names case-insensitively (an exact match
    first), as model cards spell them ("Vivian", "English") in any case.

    Field policy: an OpenAI field the model has no use for (:data:`OPENAI_OPTIONAL_FIELDS`:
    ``instructions`` where the model takes none, ``voice`` on a model without named
    voices, ``speed`` where it does not apply) is dropped and listed in
    ``ignored_fields``; any other unsupported field, and a value the model would have to
    change (an unknown voice of a model that has voices), is a 400.

    Returns:
        ``req`` with ``voice`` and ``language`` in the spelling ``caps`` declares, ``stream``
        resolved (unset: streamed when the model streams ``response_format``, as OpenAI
        does, except :data:`LENGTH_HEADER_FORMATS`), ignored fields reset to their defaults and named in ``ignored_fields``.

    Raises:
        RequestValidationError: with ``param`` naming the field, when: ``model`` is not one
            of ``caps.model_names``; ``input`` is blank (only whitespace and Unicode format
            characters such as U+200B, U+FEFF) or longer than ``caps.max_input_chars``; a
            set field is not supported (the message lists the supported fields); a value
            is not among the declared choices (voice, language, response_format; the
            message lists them); ``speed`` is out of its declared range; ``sample_rate`` is
            set for a format other than pcm or wav; ``stream: false`` with
            ``stream_format: "sse"``; ``instructions`` is too long or unspeakable. A
            model's own fields are the model's to check further (its request builder).
    """
    _check_model(req, caps)
    check_text("input", req.input, caps.max_input_chars, required=True)
    ignored = _ignored_fields(req, caps)
    if ignored:
        defaults = {name: type(req).model_fields[name].get_default() for name in ignored}
        req = req.model_copy(update={**defaults, "ignored_fields": tuple(sorted(ignored))})
    _check_supported(req, caps)
    stream = _resolve_stream(req, caps)
    _check_formats(req.model_copy(update={"stream": stream}), caps)
    _check_sample_rate(req)
    voice = _check_voice(req, caps)
    language = choice("language", req.language, caps.languages, ignore_case=True)
    _check_speed(req, caps)
    check_text("instructions", req.instructions, caps.max_input_chars)
    changed = {
        name: value
        for name, value in (("voice", voice), ("language", language), ("stream", stream))
        if value != getattr(req, name)
    }
    return req.model_copy(update=changed) if changed else req


def _ignored_fields(req: SpeechRequest, caps: SpeechCapabilities) -> set[str]:
    """The OpenAI fields ``req`` sets that ``caps``' model has no use for."""
    unused = {"voice"} if not (caps.voices or caps.default_voice) else set()
    unused |= (OPENAI_OPTIONAL_FIELDS - {"voice"}) - caps.supported_fields
    return unused & set(_set_fields(req))


def _resolve_stream(req: SpeechRequest, caps: SpeechCapabilities) -> bool:
    """``stream`` made explicit: unset means stream (OpenAI answers every speech request
    with chunked audio) when the model can stream the format and its header does not state
    the length (:data:`LENGTH_HEADER_FORMATS`), else one whole file."""
    if req.stream_format == "sse":
        if req.stream is False:
            raise RequestValidationError(
                'stream_format "sse" streams; it cannot be combined with stream: false',
                param="stream",
            )
        return True
    if req.stream is None:
        return (
            req.response_format in caps.stream_response_formats
            and req.response_format not in LENGTH_HEADER_FORMATS
        )
    return req.stream


def _check_sample_rate(req: SpeechRequest) -> None:
    if req.sample_rate is not None and req.response_format not in RESAMPLABLE_FORMATS:
        raise RequestValidationError(
            f"sample_rate applies to {' and '.join(sorted(RESAMPLABLE_FORMATS))} only, not "
            f"{req.response_format!r} (its rate is the codec's)",
            param="sample_rate",
        )


def output_sample_rate(req: SpeechRequest, caps: SpeechCapabilities) -> int:
    """Hz of the audio sent for ``req`` (``X-Sample-Rate``; the model's audio is resampled to
    it before encoding): ``sample_rate`` when set, else :data:`OPENAI_PCM_SAMPLE_RATE` for
    pcm and the model's own rate for every other format (whose header or codec carries it),
    as its codec takes it (:func:`~omnistage.serve.audio.encoded_rate`: opus is 48 kHz)."""
    if req.sample_rate is not None:
        rate = req.sample_rate
    else:
        rate = OPENAI_PCM_SAMPLE_RATE if req.response_format == "pcm" else caps.sample_rate
    return encoded_rate(req.response_format, rate)


def _check_model(req: SpeechRequest, caps: SpeechCapabilities) -> None:
    if req.model and req.model not in caps.model_names:
        raise RequestValidationError(
            f"model {req.model!r} is not served here; available models: "
            f"{', '.join(caps.model_names)}",
            param="model",
        )


_UNSPEAKABLE = re.compile("[\x00\ud800-\udfff]")


def is_blank(text: str) -> bool:
    """Only whitespace and format characters (Unicode category Cf: zero-width space U+200B,
    BOM U+FEFF, direction marks): nothing a model can speak."""
    return all(char.isspace() or unicodedata.category(char) == "Cf" for char in text)


def check_text(name: str, text: str | None, max_chars: int, required: bool = False) -> None:
    """Raises: RequestValidationError naming ``name`` when ``text`` is longer than
    ``max_chars``, holds a NUL or an unpaired surrogate, or (``required``) is blank."""
    if text is None:
        return
    if required and is_blank(text):
        raise RequestValidationError(f"{name} must not be empty", param=name)
    if len(text) > max_chars:
        raise RequestValidationError(
            f"{name} has {len(text)} characters; the maximum is {max_chars}", param=name
        )
    if _UNSPEAKABLE.search(text):
        raise RequestValidationError(f"{name} contains a NUL character or an unpaired surrogate", param=name)


def _set_fields(req: SpeechRequest) -> list[str]:
    names = []
    for name, info in type(req).model_fields.items():
        value = getattr(req, name)
        if value is None or value == [] or value == info.get_default(call_default_factory=True):
            continue
        names.append(name)
    return names


def _check_supported(req: SpeechRequest, caps: SpeechCapabilities) -> None:
    exempt = ALWAYS_ALLOWED_FIELDS | {"voice"} | _INTERNAL_FIELDS
    for name in _set_fields(req):
        if name not in exempt and name not in caps.supported_fields:
            raise RequestValidationError(
                f"field {name!r} is not supported by model {caps.model_name!r}; "
                f"supported fields: {', '.join(sorted(caps.accepted_fields))}",
                param=name,
            )


def _check_formats(req: SpeechRequest, caps: SpeechCapabilities) -> None:
    allowed = caps.stream_response_formats if req.streaming else caps.response_formats
    if req.response_format not in allowed:
        mode = "streaming response formats" if req.streaming else "response formats"
        raise RequestValidationError(
            f"response_format {req.response_format!r} is not available; "
            f"available {mode}: {', '.join(sorted(allowed))}",
            param="response_format",
        )


def _check_voice(req: SpeechRequest, caps: SpeechCapabilities) -> str | None:
    """-> the declared spelling of ``req.voice`` (None when the request names none)."""
    allowed = caps.voices or ((caps.default_voice,) if caps.default_voice else ())
    if req.voice is None:
        if caps.voices and caps.default_voice is None:
            raise RequestValidationError(
                f"voice is required; available voices: {', '.join(caps.voices)}", param="voice"
            )
        return None
    return choice("voice", req.voice, allowed, ignore_case=True)


def choice(
    name: str,
    value: str | None,
    allowed: tuple[str, ...],
    ignore_case: bool = False,
    plural: str | None = None,
) -> str | None:
    """-> the entry of ``allowed`` that ``value`` names: equal, else (``ignore_case``) the one
    equal after case folding. None stays None. ``plural`` names the choices in the error
    (default ``<name>s``).

    Raises:
        RequestValidationError: no entry matches, or several match only after case folding.
    """
    if value is None or value in allowed:
        return value
    if ignore_case:
        matches = [choice for choice in allowed if choice.casefold() == value.casefold()]
        if len(matches) == 1:
            return matches[0]
    raise RequestValidationError(
        f"{name} {value!r} is not available; available {plural or name + 's'}: {', '.join(allowed)}",
        param=name,
    )


def _check_speed(req: SpeechRequest, caps: SpeechCapabilities) -> None:
    low, high = caps.speed_range
    if not low <= req.speed <= high:
        raise RequestValidationError(
            f"speed {req.speed} is outside this model's range {low}..{high}", param="speed"
        )


# --------------------------------------------------------------------------- responses


class VoicesResponse(BaseModel):
    """Body of ``GET /v1/audio/voices``: what the served model accepts.

    ``fields``: the JSON schema (type, range, default, description) of every optional
    field the model accepts, its own fields included; ``definitions`` holds the schemas
    those refer to (``{"$ref": "#/definitions/<name>"}``).
    """

    model: str
    model_type: str
    voices: list[str]
    default_voice: str | None
    languages: list[str]
    supported_fields: list[str]
    fields: dict[str, dict[str, JsonValue]]
    definitions: dict[str, dict[str, JsonValue]]
    response_formats: list[str]
    sample_rate: int = Field(description="Hz")
    max_input_chars: int
    saved_voices: bool = Field(description="POST /v1/audio/voices saves voices for this model")


def voices_response(caps: SpeechCapabilities, request_type: type[SpeechRequest]) -> VoicesResponse:
    """Build the ``/v1/audio/voices`` body from ``caps`` and the model's schema (sorted
    field and format lists)."""
    schema = request_type.model_json_schema(ref_template="#/definitions/{model}")
    accepted = caps.accepted_fields - ALWAYS_ALLOWED_FIELDS
    return VoicesResponse(
        model=caps.model_name,
        model_type=caps.model_type,
        voices=list(caps.voices),
        default_voice=caps.default_voice,
        languages=list(caps.languages),
        supported_fields=sorted(caps.accepted_fields),
        fields={name: prop for name, prop in schema["properties"].items() if name in accepted},
        definitions=schema.get("$defs", {}),
        response_formats=sorted(caps.response_formats),
        sample_rate=caps.sample_rate,
        max_input_chars=caps.max_input_chars,
        saved_voices=caps.saved_voices,
    )


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``; ``created`` is a Unix time in seconds."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omnistage"


class ModelList(BaseModel):
    """Body of ``GET /v1/models``: ``{"object": "list", "data": [ModelCard, ...]}``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def model_card(name: str, created: int, owned_by: str = "omnistage") -> ModelCard:
    """The ``GET /v1/models/{id}`` body for served name ``name``; ``created`` in Unix s."""
    return ModelCard(id=name, created=created, owned_by=owned_by)


def model_list(model_names: tuple[str, ...], created: int, owned_by: str = "omnistage") -> ModelList:
    """One card per served name (primary name first); ``created`` in Unix s."""
    cards = [model_card(name, created, owned_by) for name in model_names]
    return ModelList(data=cards)


# --------------------------------------------------------------------------- errors


class ErrorBody(BaseModel):
    """OpenAI error object. ``code`` is the HTTP status (the vLLM/SGLang convention)."""

    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    """OpenAI error envelope ``{"error": {...}}``."""

    error: ErrorBody


MAX_ERROR_MESSAGE_CHARS = 2000
MAX_ERROR_PARAM_CHARS = 200


def _printable(text: str, limit: int) -> str:
    """``text`` as valid UTF-8 (lone surrogates escaped), cut to ``limit`` characters: an
    error never fails to encode, and never echoes a huge client value back."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def _envelope(status: int, message: str, error_type: str, param: str | None) -> tuple[int, dict]:
    message = _printable(message, MAX_ERROR_MESSAGE_CHARS)
    param = None if param is None else _printable(param, MAX_ERROR_PARAM_CHARS)
    body = ErrorBody(message=message, type=error_type, param=param, code=status)
    return status, ErrorResponse(error=body).model_dump()


def error_envelope(exc: BaseException) -> tuple[int, dict]:
    """Map an exception to ``(http_status, {"error": {message, type, param, code}})``.

    An :class:`OmnistageError` maps by type through its ``http_status`` and ``error_type``
    class attributes and its ``param`` (when it has one); a pydantic ``ValidationError`` is
    first converted by :func:`request_error_from_validation` (400). Any other exception is
    an internal error: 500 ``server_error`` with a generic message (details are not leaked).
    """
    if isinstance(exc, ValidationError):
        exc = request_error_from_validation(exc)
    if isinstance(exc, OmnistageError):
        param = getattr(exc, "param", None)
        return _envelope(exc.http_status, exc.public_message, exc.error_type, param)
    return _envelope(500, "internal server error", "server_error", None)


def not_found_envelope(message: str = "not found") -> tuple[int, dict]:
    """404 ``not_found_error`` envelope (unknown route or resource)."""
    return _envelope(404, message, "not_found_error", None)


def body_too_large(limit_bytes: int, size_bytes: int | None = None) -> PayloadTooLargeError:
    """The 413 error for a request body above ``limit_bytes`` (``size_bytes`` if known);
    map it with :func:`error_envelope`."""
    size = f" ({size_bytes} bytes)" if size_bytes is not None else ""
    return PayloadTooLargeError(f"request body{size} exceeds the limit of {limit_bytes} bytes")


# --------------------------------------------------------------------------- SSE events


class SpeechAudioDelta(BaseModel):
    """SSE event carrying one audio chunk: ``audio`` is base64 of the next bytes of the
    requested ``response_format`` (the deltas of one stream, decoded and concatenated, are
    a file of that format: raw s16le for pcm, a WAV with unknown-length sizes, mp3 frames,
    Ogg pages, ...)."""

    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str

    @classmethod
    def from_bytes(cls, chunk: bytes) -> SpeechAudioDelta:
        """Wrap raw chunk bytes (base64-encodes them)."""
        return cls(audio=base64.b64encode(chunk).decode("ascii"))


class SpeechUsage(BaseModel):
    """Usage of one speech request, OpenAI's three token counts first.

    ``input_tokens``: the model's input units (Qwen3-TTS: talker prompt positions; Piper:
    phoneme ids); ``output_tokens``: the units it generated (Qwen3-TTS: 12.5 Hz codec
    frames; Piper: sentences synthesized); ``total_tokens`` their sum.
    """

    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    input_characters: int = Field(ge=0)
    output_audio_seconds: float = Field(ge=0.0)


def usage_of(outputs: Mapping[str, object], input_characters: int, output_audio_seconds: float) -> SpeechUsage:
    """A request's usage from its terminal stages' results (``outputs``, stage ->
    result): token counts from the :class:`~omnistage.core.payloads.AudioResult` s."""
    results = [r for r in outputs.values() if isinstance(r, AudioResult)]
    input_tokens = sum(r.input_tokens for r in results)
    output_tokens = sum(r.num_frames for r in results)
    return SpeechUsage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tokens=input_tokens + output_tokens,
        input_characters=input_characters,
        output_audio_seconds=output_audio_seconds,
    )


class SpeechAudioDone(BaseModel):
    """Final SSE event of a successful stream. ``finish_reason`` is e.g. ``"stop"`` (end of
    speech) or ``"length"`` (``max_new_tokens`` reached)."""

    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: SpeechUsage
    finish_reason: str


class ErrorEvent(BaseModel):
    """Final SSE event of a failed stream (the HTTP status was already sent as 200)."""

    type: Literal["error"] = "error"
    error: ErrorBody

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorEvent:
        """Build from any exception, mapped as by :func:`error_envelope`."""
        _, body = error_envelope(exc)
        return cls(error=ErrorBody(**body["error"]))


def sse_event(obj: BaseModel | Mapping[str, JsonValue]) -> bytes:
    """Format one Server-Sent Event: ``b"event: <type>\ndata: <compact json>\n\n"``.

    The ``event:`` line repeats the JSON ``type`` field, so ``addEventListener(type)``
    listeners get the event; ``onmessage`` and line-based clients read ``type`` from the
    data. JSON never contains a raw newline, so one ``data:`` line always suffices.

    Raises:
        ValueError: ``obj`` has no string ``type``, or is a mapping holding a non-finite
            float (models serialize non-finite floats as ``null``).
    """
    payload = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else dict(obj)
    kind = payload.get("type")
    if not isinstance(kind, str) or not kind.isprintable() or "\n" in kind:
        raise ValueError(f"an SSE event needs a one-line string 'type', got {kind!r}")
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return f"event: {kind}\ndata: {text}\n\n".encode()


# --------------------------------------------------------------------------- batch

#: Most requests one ``POST /v1/audio/speech/batch`` may carry.
MAX_BATCH_REQUESTS = 64


def parse_batch(body: bytes | str | Mapping[str, JsonValue]) -> list[dict[str, JsonValue]]:
    """``{"requests": [speech request, ...]}`` -> the request bodies (each checked later,
    on its own, as a ``POST /v1/audio/speech`` body).

    Raises:
        RequestValidationError: not that shape, or 0 or more than
            :data:`MAX_BATCH_REQUESTS` requests (``param="requests"``).
    """
    data = _decode_json_object(body)
    unknown = set(data) - {"requests"}
    if unknown:
        raise RequestValidationError(f"unknown field {sorted(unknown)[0]!r}", param=sorted(unknown)[0])
    requests = data.get("requests")
    if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_BATCH_REQUESTS:
        raise RequestValidationError(
            f"requests must be a list of 1 to {MAX_BATCH_REQUESTS} speech requests", param="requests"
        )
    for i, item in enumerate(requests):
        if not isinstance(item, Mapping):
            raise RequestValidationError(f"requests.{i} must be a JSON object", param=f"requests.{i}")
    return [dict(item) for item in requests]


class BatchItem(BaseModel):
    """One result of a batch, at its request's ``index``: ``status`` 200 with the whole
    file base64 in ``audio`` (and its format, rate, finish_reason, usage, ignored fields),
    or the HTTP status the request alone would have got, with its ``error``."""

    index: int
    status: int
    response_format: ResponseFormat | None = None
    sample_rate: int | None = None
    audio: str | None = None
    finish_reason: str | None = None
    usage: SpeechUsage | None = None
    ignored_fields: list[str] | None = None
    error: ErrorBody | None = None


class BatchResponse(BaseModel):
    """Body of ``POST /v1/audio/speech/batch``: one item per request, in order."""

    object: Literal["list"] = "list"
    data: list[BatchItem]
