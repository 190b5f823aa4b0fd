"""What a Qwen3-TTS checkpoint accepts, read from its JSON files (no weights).

Three model types share one architecture (``config.json`` ``tts_model_type``); each is
served for what it does, and :func:`qwen3_tts_capabilities` declares it to the server:

==============  =============================  ==========================================
type            voice                          voice source
==============  =============================  ==========================================
base            none (a voice is ignored)      ``ref_audio`` (required) + ``ref_text``
custom_voice    a speaker (required)           ``talker_config.spk_id``; ``instructions``
                                               optional (1.7B only, see below)
voice_design    none (a voice is ignored)      ``instructions`` (required)
==============  =============================  ==========================================

``task_type`` accepts only the checkpoint's own type, spelled as in the qwen-tts API
(``Base``, ``CustomVoice``, ``VoiceDesign``), so clients written for servers that host all
three can address this one. The 0.6B CustomVoice model does not take instructions (the
reference ``qwen-tts`` 0.1.1 drops them silently: ``generate_custom_voice`` sets
``instruct = None`` for ``0b6``); here ``instructions`` is then ignored, and named in the
response's ``X-Ignored-Fields`` header (an OpenAI field this model has no use for).

Languages are ``"auto"`` plus the ``codec_language_id`` keys without ``dialect`` in their
name (as the reference's ``supported_languages``); dialects are reached through dialect
speakers (``spk_is_dialect``), a switch the prompt builder makes
(:meth:`~.modeling.prompt.PromptBuilder.custom_voice`). Voice and language names are lower
case, as :mod:`.modeling.config` reads them; the server matches them case-insensitively.

Everything here is derived from the typed configs of :mod:`.modeling.config`, which alone
reads the checkpoint's JSON files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omnistage.models.qwen3_tts.modeling.config import (
    ModelType,
    Qwen3TTSConfig,
)
from omnistage.serve.protocol import RESPONSE_FORMATS, SpeechCapabilities

SAMPLE_RATE = 24_000
"""Hz of the speech tokenizer's output (speech_tokenizer/config.json, all sizes)."""
FRAMES_PER_SECOND = 12.5
"""Talker steps per second of audio (1920 samples per frame at 24 kHz)."""
MAX_MODEL_LEN = 16384
"""Default ``max_model_len`` of the ``tts_engine`` stage (prompt positions + frames per
request): 8192 frames (:data:`~.modeling.config.MAX_NEW_TOKENS_LIMIT`) plus the longest
prompt (2,000 CJK characters are about 6,000 tokens; a 30 s ICL reference adds 375
frames). The request builder refuses what exceeds the stage's value, before any model work."""
MAX_INPUT_CHARS = 2000
"""Cap on ``input`` (also ``instructions``, ``ref_text``) in characters. Chosen so a
whole request still fits under :data:`MAX_NEW_TOKENS_LIMIT` frames when read at a slow
normal pace: 2000 Chinese characters at 3.5 characters/s are 571 s (7143 frames); Latin
text (about 14 characters/s) needs a fraction of that. Longer texts must be split by the
client instead of being cut off at the frame cap."""
AUTO_LANGUAGE = "auto"

TASK_TYPES: Mapping[ModelType, str] = {
    "base": "Base",
    "custom_voice": "CustomVoice",
    "voice_design": "VoiceDesign",
}
_SAMPLING_FIELDS = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed"}
)
_COMMON_FIELDS = _SAMPLING_FIELDS | {
    "language", "task_type", "non_streaming_mode", "initial_codec_chunk_frames", "min_new_tokens",
}  # fmt: skip
_CLONE_FIELDS = frozenset({"ref_audio", "ref_text", "references", "x_vector_only_mode"})


@dataclass(frozen=True)
class Qwen3TTSModelFacts:
    """What requests to one checkpoint may ask for, derived from its ``config.json``.

    Attributes:
        model_type: ``tts_model_type``.
        model_size: ``tts_model_size`` (``"0b6"`` or ``"1b7"``).
        voices: accepted ``voice`` values: the CustomVoice speakers
            (``talker_config.spk_id`` keys, lower case), else none: Base and VoiceDesign
            take their voice from ``ref_audio`` or ``instructions``, and the server ignores
            the ``voice`` an OpenAI client always sends (named in ``X-Ignored-Fields``).
        languages: accepted ``language`` values: ``"auto"``, then the
            ``codec_language_id`` keys that are not dialects (lower case).
        codec_eos_id: the talker's end-of-speech code (2150).
        codec_vocab_size: talker codec vocabulary (3072); ids from 2048 up are control
            codes, never sampled except EOS.
    """

    model_type: ModelType
    model_size: str
    voices: tuple[str, ...]
    languages: tuple[str, ...]
    codec_eos_id: int
    codec_vocab_size: int

    @classmethod
    def from_config(cls, config: Qwen3TTSConfig) -> Qwen3TTSModelFacts:
        """Derive the facts of ``config`` (pure; :func:`~.modeling.config.load_config`
        has checked it)."""
        talker = config.talker
        custom = config.tts_model_type == "custom_voice"
        return cls(
            model_type=config.tts_model_type,
            model_size=config.tts_model_size,
            voices=tuple(talker.spk_id) if custom else (),
            languages=(AUTO_LANGUAGE, *(name for name in talker.codec_language_id if "dialect" not in name)),
            codec_eos_id=talker.codec_eos_id,
            codec_vocab_size=talker.decoder.vocab_size,
        )

    @property
    def task_type(self) -> str:
        """The qwen-tts name of the model type (``Base``, ``CustomVoice``, ``VoiceDesign``)."""
        return TASK_TYPES[self.model_type]

    @property
    def accepts_instructions(self) -> bool:
        """VoiceDesign (required there) and CustomVoice except 0.6B (module docstring)."""
        if self.model_type == "custom_voice":
            return self.model_size != "0b6"
        return self.model_type == "voice_design"


def qwen3_tts_capabilities(
    facts: Qwen3TTSModelFacts, model_names: tuple[str, ...]
) -> SpeechCapabilities:
    """The server-side declaration of what ``facts``' model accepts (module docstring).

    Fields of :class:`~.request_builders.Qwen3TTSSpeechRequest`: the framework's sampling
    and ``language`` fields and the model's own. ``speed`` is ignored (the model has no duration control; the response names it in
    ``X-Ignored-Fields``).
    """
    fields = set(_COMMON_FIELDS)
    if facts.model_type == "base":
        fields |= _CLONE_FIELDS
    if facts.accepts_instructions:
        fields.add("instructions")
    return SpeechCapabilities(
        model_names=model_names,
        model_type="qwen3_tts",
        supported_fields=frozenset(fields),
        voices=facts.voices,
        languages=facts.languages,
        sample_rate=SAMPLE_RATE,
        max_input_chars=MAX_INPUT_CHARS,
        response_formats=RESPONSE_FORMATS,
        stream_response_formats=RESPONSE_FORMATS,
        saved_voices=facts.model_type == "base",
        live_text_input=True,
    )
