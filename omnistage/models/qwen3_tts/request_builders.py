"""The Qwen3-TTS speech request schema, and speech request -> :class:`Qwen3TTSRequest`:
all validation before any model work.

:class:`Qwen3TTSSpeechRequest` is the model's ``/v1/audio/speech`` schema: the framework's
fields plus Qwen3-TTS's own (``task_type``, the voice-clone fields, ``non_streaming_mode``,
``initial_codec_chunk_frames``, ``min_new_tokens``), typed and ranged by pydantic.

Precondition: the request is what :func:`~omnistage.serve.protocol.validate_speech_request`
returned against :func:`~.capabilities.qwen3_tts_capabilities` of the same checkpoint (the
server does this first), so ``voice`` and ``language`` are declared (lower-case) names.
That check already rejects, naming the field: unknown speaker or language (listing the
allowed ones), blank or too long text,
``ref_audio``/``ref_text``/``references``/``x_vector_only_mode`` on CustomVoice and
VoiceDesign, and the sampling ranges the wire format has (temperature >= 0,
top_k >= 0 (-1 = 0), 0 < top_p <= 1, repetition_penalty > 0,
initial_codec_chunk_frames >= 0); it drops, naming them in ``ignored_fields``, the OpenAI
fields the checkpoint has no use for: ``instructions`` on Base (and on 0.6B CustomVoice),
``voice`` on Base and VoiceDesign (a Base saved voice is resolved before it), ``speed``. This builder adds the rules of the model's own fields
and those that need the model type:

- ``task_type``, when given, must be the checkpoint's (``Base``, ``CustomVoice`` or
  ``VoiceDesign``); ``ref_audio`` and ``references`` exclude each other; ``ref_text`` needs
  ``ref_audio``; ``x_vector_only_mode`` needs a reference; ``ref_text`` and reference
  transcripts obey the input's length cap.

- VoiceDesign needs non-blank ``instructions``; blank ``instructions`` are refused anywhere.
- Base clones a voice: ``ref_audio`` (or ``references`` with exactly one item) is required.
  Mode selection, never guessed:

  * ``ref_text`` given -> in-context clone (ICL: reference codes and transcript in the
    prompt; the higher-similarity mode);
  * no ``ref_text`` and ``x_vector_only_mode: true`` -> speaker-embedding-only clone;
  * no ``ref_text`` and no ``x_vector_only_mode`` -> 400 on ``ref_text`` (as the reference
    qwen-tts raises): a missing transcript must not silently downgrade the clone;
  * ``ref_text`` with ``x_vector_only_mode: true`` -> 400 on ``ref_text``: the mode would
    drop the transcript.
- Reference audio: any format FFmpeg decodes, any rate and channel count (media policy of
  the server for data URI / base64 / URL / path); mono by channel average, resampled to
  24 kHz; 0.5..30 s (:data:`MIN_REF_SECONDS`, :data:`MAX_REF_SECONDS`); not silent.
- The prompt fits the ``tts_engine`` stage: its positions (counted from token ids and the
  reference's frames, :meth:`~.modeling.prompt.PromptTokens.size`) plus the frames to
  generate are at most the stage's ``max_model_len`` (:class:`RequestLimits`); else 400 on
  ``max_new_tokens`` when the client set it and the prompt alone fits, on ``input``
  otherwise. The engine never has to refuse a request after the prompt was built.
- ``seed`` 0..2**31-1 (the sampler's hash seed), ``max_new_tokens`` 1..8192,
  ``min_new_tokens`` at most ``max_new_tokens`` when both are given; ``temperature``,
  ``top_p`` and ``repetition_penalty`` 0 or within float32's normal range (the sampler's
  dtype).
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omnistage.core.errors import RequestValidationError
from omnistage.engine.sampler import SamplingParams
from omnistage.models.qwen3_tts.capabilities import (
    AUTO_LANGUAGE,
    FRAMES_PER_SECOND,
    MAX_INPUT_CHARS,
    SAMPLE_RATE,
    Qwen3TTSModelFacts,
)
from omnistage.models.qwen3_tts.modeling.config import (
    MAX_NEW_TOKENS_LIMIT,
    GenerationConfig,
    load_config,
    load_generation_config,
)
from omnistage.models.qwen3_tts.modeling.prompt import PromptTokens
from omnistage.models.qwen3_tts.modeling.weights import load_text_tokenizer
from omnistage.models.qwen3_tts.payload_types import (
    Qwen3TTSRequest,
    Qwen3TTSSampling,
    SamplingOverrides,
)
from omnistage.serve.media import MediaPolicy, ReferenceAudio, ReferenceClip, load_reference_audio
from omnistage.serve.protocol import SpeechRequest, check_text, choice, is_blank


class Qwen3TTSReference(BaseModel):
    """One reference clip for voice cloning: ``audio`` (base64, data URI, URL or path, kept
    as the raw string; resolved by the media layer; alias ``audio_path``, SGLang-Omni's
    spelling) and its optional transcript ``text``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    audio: str = Field(min_length=1)
    text: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _audio_path_alias(cls, data: object) -> object:
        if not isinstance(data, Mapping) or "audio_path" not in data:
            return data
        data = dict(data)
        path = data.pop("audio_path")
        if "audio" in data and data["audio"] != path:
            raise RequestValidationError(
                "'audio' and its alias 'audio_path' are both set with different values; set only one",
                param="references",
            )
        data["audio"] = path
        return data


class Qwen3TTSSpeechRequest(SpeechRequest):
    """``POST /v1/audio/speech`` for Qwen3-TTS: the framework's fields plus these (which of
    them a checkpoint accepts: :func:`~.capabilities.qwen3_tts_capabilities`)."""

    task_type: str | None = Field(
        default=None, description="the checkpoint's type as qwen-tts spells it (Base, CustomVoice, VoiceDesign)"
    )
    ref_audio: str | None = Field(
        default=None, min_length=1, description="voice-clone reference clip: base64, data URI, URL or path"
    )
    ref_text: str | None = Field(default=None, description="transcript of ref_audio (in-context clone)")
    references: list[Qwen3TTSReference] | None = Field(
        default=None, description="the reference as a list of one {audio, text}"
    )
    x_vector_only_mode: bool = Field(
        default=False, description="clone from the speaker embedding alone (no ref_text)"
    )
    non_streaming_mode: bool | None = Field(
        default=None,
        description="text feeding: true = the whole text in the prompt, false = one text "
        "token per generated frame; null = the model type's default",
    )
    initial_codec_chunk_frames: int | None = Field(
        default=None, ge=0, le=2**31 - 1, description="frames of the first streamed chunk (capped at 8)"
    )
    min_new_tokens: int | None = Field(
        default=None, ge=0, le=MAX_NEW_TOKENS_LIMIT, description="frames before EOS may end the request"
    )


MIN_REF_SECONDS = 0.5
"""Shortest reference: 6 codec frames, about 45 speaker-encoder mel frames (hop 256 at
24 kHz). Below that the x-vector's statistics pooling averages too little speech to hold
a voice, and the request would return some other voice without saying so."""
MAX_REF_SECONDS = 30.0
"""Longest reference. ICL puts every reference frame into the prompt (30 s = 375 frames
plus the transcript) and the vocoder's first chunk decodes the reference codes as left
context, so prefill and first-chunk cost grow with it; the speaker identity is settled
long before 30 s. Applied as the media policy's duration cap (decoding stops there, 413)."""
SILENT_PEAK = 1e-4
"""A reference whose peak is below -80 dBFS is digital silence: no voice to clone."""
MAX_SEED = 2**31 - 1
FLOAT32_FIELDS = ("temperature", "top_p", "repetition_penalty")
"""Sampling fields the engine holds as float32 tensors: a value that overflows to inf or
flushes to 0 there (temperature 1e300 raised in the engine's prefill and failed every
request coalesced with it) is refused here, naming the field."""
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)

# Seconds of speech per text unit at a slow reading pace (see max_frames_for_text).
LEAD_SECONDS = 2.0
SECONDS_PER_CJK = 0.5
SECONDS_PER_DIGIT = 0.4
SECONDS_PER_OTHER = 0.2
_CJK = re.compile(
    "[\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
    "\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003ffff]"
)
_DIGIT = re.compile(r"\d")
_SPACE = re.compile(r"\s")


REFERENCE_MIN_NEW_TOKENS = 2  # qwen-tts generate(): EOS is masked for the first 2 frames


def max_frames_for_text(text: str, limit: int = MAX_NEW_TOKENS_LIMIT) -> int:
    """Frame cap proportional to ``text``, so a request that misses EOS stops early.

    ``frames = min(limit, ceil(12.5 * (2.0 + 0.5 * n_cjk + 0.4 * n_digit + 0.2 * n_other)))``
    where ``n_cjk`` counts Han, kana and Hangul characters, ``n_digit`` digits, ``n_other``
    every other non-space character (letters, punctuation); whitespace counts nothing.

    The per-unit seconds are slow-pace ceilings, at least twice normal read speech, so a
    normal reading is never cut: English read aloud runs about 14 characters/s with
    spaces (~0.08 s per non-space character; 0.2 s gives 2.5x for slow, instructed or
    expressive speech and the pauses punctuation brings); a digit reads as a word
    ("2024" is about 1.1 s, 0.28 s per digit; 0.4 s); Mandarin runs 4-5 characters/s
    (0.2-0.25 s), Korean about 6 syllables/s, Japanese 7-8 morae/s with about 2 morae per
    kanji (0.5 s is over twice the slowest). The 2 s lead covers leading/trailing silence
    and one-word inputs. 12.5 frames per second (80 ms frames). Field report (reference
    issue #1179): about 0.34% of 0.6B requests never sample EOS after the sentence ends
    and, uncapped, run to max_new_tokens (8192 frames = 655 s); with this cap they stop
    within about 2.5x the text's normal duration, with finish_reason "length".

    Args:
        text: the text to speak.
        limit: the highest cap (frames), :data:`MAX_NEW_TOKENS_LIMIT` by default.

    Returns:
        Frames, in ``[25, limit]`` (25 = the lead alone) when ``limit >= 25``.
    """
    n_cjk = len(_CJK.findall(text))
    n_digit = len(_DIGIT.findall(text))
    n_other = len(text) - n_cjk - n_digit - len(_SPACE.findall(text))
    seconds = (
        LEAD_SECONDS
        + SECONDS_PER_CJK * n_cjk
        + SECONDS_PER_DIGIT * n_digit
        + SECONDS_PER_OTHER * n_other
    )
    return min(limit, math.ceil(FRAMES_PER_SECOND * seconds))


SAMPLES_PER_FRAME = round(SAMPLE_RATE / FRAMES_PER_SECOND)
"""24 kHz samples per codec frame (1920): an ICL reference of ``S`` samples puts
``ceil(S / 1920)`` frames in the prompt (the speech tokenizer's encoder)."""


@dataclass(frozen=True)
class RequestLimits:
    """What one served pipeline allows a request beyond its schema.

    Attributes:
        tokens: the checkpoint's prompt token ids (its tokenizer; no model).
        max_model_len: the ``tts_engine`` stage's ``max_model_len`` (prompt + frames).
        default_max_new_tokens: generation_config.json's ``max_new_tokens``.
    """

    tokens: PromptTokens
    max_model_len: int
    default_max_new_tokens: int


def load_request_limits(model_path: str | Path, max_model_len: int) -> RequestLimits:
    """The :class:`RequestLimits` of the checkpoint at ``model_path`` under a ``tts_engine``
    stage of ``max_model_len``: its tokenizer and generation_config.json (CPU only).

    Raises:
        CheckpointConfigError: config.json or generation_config.json missing or invalid.
        OSError: the tokenizer files cannot be loaded.
    """
    tokens = PromptTokens(load_config(model_path), load_text_tokenizer(model_path))
    return RequestLimits(tokens, max_model_len, load_generation_config(model_path).max_new_tokens)


def build_qwen3_tts_request(
    request: Qwen3TTSSpeechRequest,
    facts: Qwen3TTSModelFacts,
    media: MediaPolicy,
    limits: RequestLimits,
    *,
    more_text: bool = False,
) -> Qwen3TTSRequest:
    """Validate ``request`` for the checkpoint ``facts`` describes and the pipeline
    ``limits`` describes (rules: module docstring).

    ``more_text``: the text continues while the request runs (a live session); it is fed
    in streaming text mode, one token per frame, so ``non_streaming_mode`` defaults to
    false and ``true`` is refused (the whole text would have to be in the prompt first).

    Blocks on reference audio (fetch, decode): the server calls it from a worker thread.

    Raises:
        RequestValidationError: naming the field (``instructions``, ``ref_audio``,
            ``references``, ``ref_text``, ``seed``, ``max_new_tokens``, ``input``,
            ``non_streaming_mode``).
        PayloadTooLargeError: reference audio over the media policy's byte cap or longer
            than :data:`MAX_REF_SECONDS` (or the policy's duration cap, if lower).
    """
    choice("task_type", request.task_type, (facts.task_type,), plural="task types")
    _check_reference_fields(request)
    _check_generation_limits(request)
    instructions = _instructions(request, facts)
    if more_text and request.non_streaming_mode:
        raise RequestValidationError(
            "text sent as it is written is fed one token per frame (non_streaming_mode false); "
            "non_streaming_mode true needs the whole text first: send it to /v1/audio/speech",
            param="non_streaming_mode",
        )
    reference, ref_text, x_vector_only = _voice_clone(request, facts, media)
    built = Qwen3TTSRequest(
        text=request.input,
        target_ids=limits.tokens.target(request.input),
        model_type=facts.model_type,
        language=request.language or AUTO_LANGUAGE,
        voice=request.voice if facts.model_type == "custom_voice" else None,
        instructions=instructions,
        ref_audio=None if reference is None else reference.samples,
        ref_key=None if reference is None else reference.key,
        ref_text=ref_text,
        x_vector_only=x_vector_only,
        # Reference defaults: streaming text for voice clone, whole text otherwise.
        non_streaming_mode=(
            request.non_streaming_mode
            if request.non_streaming_mode is not None
            else facts.model_type != "base" and not more_text
        ),
        sampling=SamplingOverrides(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            repetition_penalty=request.repetition_penalty,
        ),
        seed=request.seed if request.seed is not None else secrets.randbelow(MAX_SEED + 1),
        max_new_tokens=request.max_new_tokens,
        min_new_tokens=_min_new_tokens(request),
        frame_cap=max_frames_for_text(request.input),
        initial_codec_chunk_frames=request.initial_codec_chunk_frames,
        stream=request.streaming,
        more_text=more_text,
    )
    _check_fits(built, limits)
    return built


def _check_fits(request: Qwen3TTSRequest, limits: RequestLimits) -> None:
    """The prompt ``L`` (and its step rows ``M``) plus the frames to generate ``N`` fit the
    engine: ``L + N <= max_model_len`` and ``M + 1 <= max_model_len`` (the engine's pools
    hold one request of ``max_model_len``, so this is every check it makes)."""
    ref_frames = math.ceil(len(request.ref_audio) / SAMPLES_PER_FRAME) if request.ref_text is not None else 0
    tokens = limits.tokens
    size = tokens.size(
        request.target_ids.text, tokens.language_id(request.language, request.voice), request.model_type != "voice_design",
        request.instructions, request.non_streaming_mode, request.ref_text, ref_frames,
    )  # fmt: skip
    frames, limit = frames_to_generate(request, limits.default_max_new_tokens), limits.max_model_len
    if size.prefill + frames <= limit and size.step_rows + 1 <= limit:
        return
    prompt = f"the prompt takes {size.prefill} positions and {size.step_rows} step rows"
    if request.ref_text is not None:
        prompt += f" (with ref_text and {ref_frames} frames of reference audio)"
    if request.max_new_tokens is not None and size.prefill < limit and size.step_rows < limit:
        raise RequestValidationError(
            f"max_new_tokens {frames} is too many for this input: {prompt}, and prompt + frames are at "
            f"most {limit} (the tts_engine stage's max_model_len); ask for at most {limit - size.prefill}",
            param="max_new_tokens",
        )
    raise RequestValidationError(
        f"input is too long for this server: {prompt}, and with the {frames} frames to generate they "
        f"exceed {limit} (the tts_engine stage's max_model_len); shorten input (or ref_text), or split it",
        param="input",
    )


def _check_reference_fields(request: Qwen3TTSSpeechRequest) -> None:
    if request.ref_audio is not None and request.references:
        raise RequestValidationError("set ref_audio or references, not both", param="references")
    if request.ref_text is not None and request.ref_audio is None:
        raise RequestValidationError("ref_text needs ref_audio", param="ref_text")
    if request.x_vector_only_mode and request.ref_audio is None and not request.references:
        raise RequestValidationError(
            "x_vector_only_mode needs ref_audio or references", param="x_vector_only_mode"
        )
    check_text("ref_text", request.ref_text, MAX_INPUT_CHARS)
    for i, ref in enumerate(request.references or ()):
        check_text(f"references.{i}.text", ref.text, MAX_INPUT_CHARS)


def _check_generation_limits(request: SpeechRequest) -> None:
    for name in FLOAT32_FIELDS:
        value = getattr(request, name)
        if value is not None and value != 0 and not FLOAT32_TINY <= value <= FLOAT32_MAX:
            raise RequestValidationError(
                f"{name} {value:g} is outside the sampler's float32 range "
                f"{FLOAT32_TINY:.3g}..{FLOAT32_MAX:.3g}",
                param=name,
            )
    if request.seed is not None and request.seed > MAX_SEED:
        raise RequestValidationError(f"seed must be 0..{MAX_SEED}", param="seed")
    if request.max_new_tokens is not None and request.max_new_tokens > MAX_NEW_TOKENS_LIMIT:
        raise RequestValidationError(
            f"max_new_tokens must be 1..{MAX_NEW_TOKENS_LIMIT} (frames of 80 ms)",
            param="max_new_tokens",
        )


def _min_new_tokens(request: Qwen3TTSSpeechRequest) -> int:
    """``min_new_tokens``: frames before EOS may end the request (at least the reference's
    2). Benchmarks set it equal to ``max_new_tokens`` for fixed lengths."""
    value = REFERENCE_MIN_NEW_TOKENS if request.min_new_tokens is None else request.min_new_tokens
    if request.max_new_tokens is not None and value > request.max_new_tokens:
        raise RequestValidationError(
            f"min_new_tokens ({value}) exceeds max_new_tokens ({request.max_new_tokens})",
            param="min_new_tokens",
        )
    return max(REFERENCE_MIN_NEW_TOKENS, value)


def _instructions(request: Qwen3TTSSpeechRequest, facts: Qwen3TTSModelFacts) -> str | None:
    text = request.instructions
    if text is not None and is_blank(text):
        raise RequestValidationError(
            "instructions must not be blank; omit the field", param="instructions"
        )
    if text is None and facts.model_type == "voice_design":
        raise RequestValidationError(
            "a VoiceDesign model needs instructions describing the voice", param="instructions"
        )
    return text


def _voice_clone(
    request: Qwen3TTSSpeechRequest, facts: Qwen3TTSModelFacts, media: MediaPolicy
) -> tuple[ReferenceClip | None, str | None, bool]:
    """-> (reference clip [S] at 24 kHz, its transcript, x-vector-only) for Base."""
    if facts.model_type != "base":
        return None, None, False
    audio, text, audio_param, text_param = (
        request.ref_audio,
        request.ref_text,
        "ref_audio",
        "ref_text",
    )
    if request.references:
        if len(request.references) > 1:
            raise RequestValidationError(
                f"Qwen3-TTS clones from one reference; got {len(request.references)}",
                param="references",
            )
        reference = request.references[0]
        audio, text, audio_param, text_param = (
            reference.audio,
            reference.text,
            "references.0.audio",
            "references.0.text",
        )
    if audio is None:
        raise RequestValidationError(
            "a Base model clones a voice: send ref_audio (and ref_text, its transcript), or name "
            "a saved voice as voice (GET /v1/audio/voices lists them)",
            param="ref_audio",
        )
    if text is not None and not text.strip():
        raise RequestValidationError(f"{text_param} must not be blank", param=text_param)
    if text is not None and request.x_vector_only_mode:
        raise RequestValidationError(
            f"x_vector_only_mode does not use {text_param}; omit one of them", param=text_param
        )
    if text is None and not request.x_vector_only_mode:
        raise RequestValidationError(
            f"{text_param} (the transcript of the reference audio) is required for in-context "
            "cloning; or set x_vector_only_mode: true to clone from the speaker embedding "
            "alone (lower similarity)",
            param=text_param,
        )
    return load_reference(audio, media, audio_param), text, request.x_vector_only_mode


def load_reference(value: str, media: MediaPolicy, param: str = "ref_audio") -> ReferenceClip:
    """Decode reference audio to what the speech tokenizer and speaker encoder take, or take
    it from the media policy's reference cache (a clip sent again: no decoding, checking or
    resampling, :func:`~omnistage.serve.media.load_reference_audio`).

    Args:
        value: the request field (data URI, base64, URL or path; see
            :mod:`omnistage.serve.media`).
        media: the server's media policy; its duration cap is lowered to
            :data:`MAX_REF_SECONDS`.
        param: the field name reported in errors.

    Returns:
        Read-only mono float32 ``[S]`` at 24 kHz (channel average, soxr HQ resampling),
        and its content key.

    Raises:
        RequestValidationError: undecodable, shorter than :data:`MIN_REF_SECONDS`,
            non-finite samples, or silent (every time it is sent: a refused clip is not
            cached).
        PayloadTooLargeError: over the byte cap or the duration cap.
    """
    policy = replace(media, max_duration_s=min(media.max_duration_s, MAX_REF_SECONDS))
    return load_reference_audio(value, policy, param, sample_rate=SAMPLE_RATE, check=check_reference)


def check_reference(audio: ReferenceAudio, param: str) -> None:
    """The reference rules on a decoded clip (at its own rate; its samples are finite,
    :func:`~omnistage.serve.media.decode_audio`): at least :data:`MIN_REF_SECONDS`, a peak
    of at least :data:`SILENT_PEAK`.

    Raises:
        RequestValidationError: naming ``param``.
    """
    if audio.duration_s < MIN_REF_SECONDS:
        raise RequestValidationError(
            f"{param} is {audio.duration_s:.2f} s long; at least {MIN_REF_SECONDS} s of speech is needed",
            param=param,
        )
    if np.abs(audio.samples).max() < SILENT_PEAK:
        raise RequestValidationError(
            f"{param} is silent; send a recording of the voice", param=param
        )


def resolve_sampling(
    request: Qwen3TTSRequest, defaults: GenerationConfig, facts: Qwen3TTSModelFacts
) -> Qwen3TTSSampling:
    """The request's sampling for the engine: client values over generation_config.json.

    - temperature, top_k, top_p from the client apply to both the talker and the code
      predictor (the API has one set; the checkpoints' defaults are equal for both), so
      ``temperature: 0`` makes the whole frame greedy. Unset, each takes its own default;
      a ``do_sample: false`` default means greedy (temperature 0).
    - repetition_penalty: talker only (the reference applies none to the code predictor).
    - talker: EOS (``codec_eos_id``) stops; the control codes (the top 1024 ids, 2048..3071)
      other than EOS are never sampled; ``min_new_tokens`` 2 (reference qwen-tts ``generate``).
    - max_new_tokens: the client's value when given (1..8192, it may exceed the text cap:
      the client asked for it); else ``min(frame_cap, generation_config max_new_tokens)``,
      raised to ``min_new_tokens`` when that is larger.
    - both samplers get ``request.seed``; the engine keys the code predictor's draws
      (frame, group) on a noise stream of their own, so they never repeat code 0's.
    """
    talker, code_predictor = sampling_params(request.sampling, request.seed, request.min_new_tokens, defaults, facts)
    return Qwen3TTSSampling(
        talker=talker, code_predictor=code_predictor,
        max_new_tokens=frames_to_generate(request, defaults.max_new_tokens),
    )


def frames_to_generate(request: Qwen3TTSRequest, default_max_new_tokens: int) -> int:
    """The request's frame cap: the client's ``max_new_tokens``, else the text's cap
    (``frame_cap``) within generation_config.json's ``max_new_tokens``, raised to an
    explicit ``min_new_tokens`` (the client asked for it). A request with ``more_text``
    reserves generation_config's ``max_new_tokens`` until its whole text is known (the
    engine holds KV for it; ``tts_engine`` then lowers the cap to the whole text's)."""
    if request.max_new_tokens is not None:
        return request.max_new_tokens
    if request.more_text:  # the text's cap is known once the text is: reserve the most
        return max(default_max_new_tokens, request.min_new_tokens)
    return text_frame_cap(request.frame_cap, default_max_new_tokens, request.min_new_tokens)


def text_frame_cap(frame_cap: int, limit: int, min_new_tokens: int) -> int:
    """Frames a request without a client ``max_new_tokens`` may make: its text's cap
    (:func:`max_frames_for_text`) at most ``limit`` (generation_config's
    ``max_new_tokens``), raised to an explicit ``min_new_tokens`` (the client asked for it)."""
    return max(min(frame_cap, limit), min_new_tokens)


def sampling_params(
    overrides: SamplingOverrides, seed: int, min_new_tokens: int, defaults: GenerationConfig, facts: Qwen3TTSModelFacts
) -> tuple[SamplingParams, SamplingParams]:
    """(talker, code predictor) :class:`SamplingParams`: ``overrides`` over
    generation_config.json, as :func:`resolve_sampling` describes."""
    o = overrides

    def pick(value, default):
        return default if value is None else value

    talker_temperature = defaults.temperature if defaults.do_sample else 0.0
    predictor_temperature = defaults.subtalker_temperature if defaults.subtalker_dosample else 0.0
    # The top 1024 talker ids are control codes (reference: suppress_tokens =
    # range(vocab_size - 1024, vocab_size) minus EOS); below them are the 2048 audio codes.
    control_start = facts.codec_vocab_size - 1024
    eos = facts.codec_eos_id
    talker = SamplingParams(
        temperature=pick(o.temperature, talker_temperature),
        top_k=pick(o.top_k, defaults.top_k),
        top_p=pick(o.top_p, defaults.top_p),
        repetition_penalty=pick(o.repetition_penalty, defaults.repetition_penalty),
        min_new_tokens=min_new_tokens,
        stop_token_ids=(eos,),
        suppress_ranges=((control_start, eos), (eos + 1, facts.codec_vocab_size)),
        seed=seed,
    )
    code_predictor = SamplingParams(
        temperature=pick(o.temperature, predictor_temperature),
        top_k=pick(o.top_k, defaults.subtalker_top_k),
        top_p=pick(o.top_p, defaults.subtalker_top_p),
        seed=seed,
    )
    return talker, code_predictor
