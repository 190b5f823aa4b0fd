"""What a Qwen3-TTS checkpoint accepts, read from its JSON files (no weights).

Three model types share one architecture (``config.json`` ``tts_model_type``); each is
served for what it does, and :func:`qwen3_tts_capabilities` declares it to the server:

==============  =============================  ==========================================
type            voice                          voice source
==============  =============================  ==========================================
base            omitted or ``"default"``       ``ref_audio`` (required) + ``ref_text``
custom_voice    a speaker (required)           ``talker_config.spk_id``; ``instructions``
                                               optional (1.7B only, see below)
voice_design    omitted or ``"default"``       ``instructions`` (required)
==============  =============================  ==========================================

``task_type`` accepts only the checkpoint's own type, spelled as in the qwen-tts API
(``Base``, ``CustomVoice``, ``VoiceDesign``), so clients written for servers that host all
three can address this one. The 0.6B CustomVoice model does not take instructions (the
reference ``qwen-tts`` 0.1.1 drops them silently: ``generate_custom_voice`` sets
``instruct = None`` for ``0b6``); here ``instructions`` is then an unsupported field (400).

Languages are ``"auto"`` plus the ``codec_language_id`` keys without ``dialect`` in their
name (as the reference's ``supported_languages``); dialects are reached through dialect
speakers (``spk_is_dialect``), see :meth:`Qwen3TTSModelFacts.language_id`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omnistage.engine.sampler import SamplingParams
from omnistage.serve.protocol import RESPONSE_FORMATS, SpeechCapabilities

ModelType = Literal["base", "custom_voice", "voice_design"]

SAMPLE_RATE = 24_000
"""Hz of the speech tokenizer's output (speech_tokenizer/config.json, all sizes)."""
FRAMES_PER_SECOND = 12.5
"""Talker steps per second of audio (1920 samples per frame at 24 kHz)."""
MAX_NEW_TOKENS_LIMIT = 8192
"""Highest frame cap a request may ask for: generation_config.json's max_new_tokens
(655 s of audio)."""
MAX_INPUT_CHARS = 2000
"""Cap on ``input`` (also ``instructions``, ``ref_text``) in characters. Chosen so a
whole request still fits under :data:`MAX_NEW_TOKENS_LIMIT` frames when read at a slow
normal pace: 2000 Chinese characters at 3.5 characters/s are 571 s (7143 frames); Latin
text (about 14 characters/s) needs a fraction of that. Longer texts must be split by the
client instead of being cut off at the frame cap."""
DEFAULT_VOICE = "default"
"""The one voice name of Base and VoiceDesign models (their voice comes from ``ref_audio``
or ``instructions``); OpenAI clients always send a voice, so it has a name."""
AUTO_LANGUAGE = "auto"

TASK_TYPES: Mapping[ModelType, str] = {
    "base": "Base",
    "custom_voice": "CustomVoice",
    "voice_design": "VoiceDesign",
}
_ARCHITECTURE = "Qwen3TTSForConditionalGeneration"
_TOKENIZER_TYPE = "qwen3_tts_tokenizer_12hz"
_SAMPLING_FIELDS = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed"}
)
_COMMON_FIELDS = _SAMPLING_FIELDS | {
    "language", "task_type", "non_streaming_mode", "initial_codec_chunk_frames",
}  # fmt: skip
_CLONE_FIELDS = frozenset({"ref_audio", "ref_text", "references", "x_vector_only_mode"})


@dataclass(frozen=True)
class Qwen3TTSModelFacts:
    """The request-relevant facts of one checkpoint's ``config.json``.

    Attributes:
        model_type: ``tts_model_type``.
        model_size: ``tts_model_size`` (``"0b6"`` or ``"1b7"``).
        speakers: CustomVoice speaker name -> codec id (``talker_config.spk_id``); empty for
            Base and VoiceDesign.
        speaker_dialects: speaker -> dialect language key (``spk_is_dialect``, false
            entries left out).
        language_ids: language key -> codec id (``talker_config.codec_language_id``,
            dialects included).
        codec_eos_id: the talker's end-of-speech code (2150).
        codec_vocab_size: talker codec vocabulary (3072); ids from 2048 up are control
            codes, never sampled except EOS.
    """

    model_type: ModelType
    model_size: str
    speakers: Mapping[str, int]
    speaker_dialects: Mapping[str, str]
    language_ids: Mapping[str, int]
    codec_eos_id: int
    codec_vocab_size: int

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> Qwen3TTSModelFacts:
        """Read ``<checkpoint_dir>/config.json``.

        Raises:
            FileNotFoundError: no config.json.
            ValueError: not a 12 Hz Qwen3-TTS config, or a field is missing or malformed
                (the message names the file and the field).
        """
        path = Path(checkpoint_dir) / "config.json"
        with path.open(encoding="utf-8") as file:
            config = json.load(file)
        try:
            return cls._from_config(config)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a usable Qwen3-TTS 12 Hz config: {exc}") from None

    @classmethod
    def _from_config(cls, config: Mapping[str, Any]) -> Qwen3TTSModelFacts:
        if _ARCHITECTURE not in config["architectures"]:
            raise ValueError(f"architectures {config['architectures']} lack {_ARCHITECTURE}")
        if config["tokenizer_type"] != _TOKENIZER_TYPE:
            raise ValueError(
                f"tokenizer_type {config['tokenizer_type']!r} is not {_TOKENIZER_TYPE!r}"
            )
        model_type = config["tts_model_type"]
        if model_type not in TASK_TYPES:
            raise ValueError(f"tts_model_type {model_type!r} is not one of {sorted(TASK_TYPES)}")
        talker = config["talker_config"]
        speakers = {
            name: _codec_id(value, f"spk_id.{name}") for name, value in talker["spk_id"].items()
        }
        languages = {
            name: _codec_id(value, f"codec_language_id.{name}")
            for name, value in talker["codec_language_id"].items()
        }
        dialects = {name: d for name, d in (talker.get("spk_is_dialect") or {}).items() if d}
        for speaker, dialect in dialects.items():
            if speaker not in speakers or dialect not in languages:
                raise ValueError(
                    f"spk_is_dialect.{speaker} = {dialect!r} names no speaker/language"
                )
        if model_type == "custom_voice" and not speakers:
            raise ValueError("a custom_voice model needs talker_config.spk_id speakers")
        return cls(
            model_type=model_type,
            model_size=str(config["tts_model_size"]),
            speakers=speakers,
            speaker_dialects=dialects,
            language_ids=languages,
            codec_eos_id=int(talker["codec_eos_token_id"]),
            codec_vocab_size=int(talker["vocab_size"]),
        )

    @property
    def task_type(self) -> str:
        """The qwen-tts name of the model type (``Base``, ``CustomVoice``, ``VoiceDesign``)."""
        return TASK_TYPES[self.model_type]

    @property
    def languages(self) -> tuple[str, ...]:
        """Accepted ``language`` values: ``"auto"``, then the non-dialect languages."""
        return (AUTO_LANGUAGE, *(name for name in self.language_ids if "dialect" not in name))

    @property
    def voices(self) -> tuple[str, ...]:
        """Accepted ``voice`` values: the speakers, or ``("default",)``."""
        return tuple(self.speakers) if self.model_type == "custom_voice" else (DEFAULT_VOICE,)

    @property
    def accepts_instructions(self) -> bool:
        """VoiceDesign (required there) and CustomVoice except 0.6B (module docstring)."""
        if self.model_type == "custom_voice":
            return self.model_size != "0b6"
        return self.model_type == "voice_design"

    def language_id(self, language: str, speaker: str | None) -> int | None:
        """The codec language id of the prompt's think prefix; None for ``"auto"``.

        A dialect speaker (``eric`` -> sichuan_dialect) speaks its dialect when the language
        is ``chinese`` or ``"auto"`` (reference qwen-tts ``generate``), else ``language``.
        """
        dialect = self.speaker_dialects.get(speaker or "")
        if dialect is not None and language in (AUTO_LANGUAGE, "chinese"):
            return self.language_ids[dialect]
        return None if language == AUTO_LANGUAGE else self.language_ids[language]


def _codec_id(value: Any, name: str) -> int:
    """A codec id given as an int or a one-element list (both occur in real configs)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int or a one-element list, got {value!r}")
    return value


@dataclass(frozen=True)
class GenerationDefaults:
    """``generation_config.json``: the sampling used where a request sets nothing.

    Attributes:
        do_sample, temperature, top_k, top_p, repetition_penalty: the talker's (code 0).
        subtalker_do_sample, subtalker_temperature, subtalker_top_k, subtalker_top_p: the
            code predictor's (codes 1..15).
        max_new_tokens: frame cap (<= :data:`MAX_NEW_TOKENS_LIMIT`).
    """

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    subtalker_do_sample: bool
    subtalker_temperature: float
    subtalker_top_k: int
    subtalker_top_p: float
    max_new_tokens: int

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> GenerationDefaults:
        """Read ``<checkpoint_dir>/generation_config.json`` (mandatory in Qwen3-TTS
        checkpoints: the reference loader raises without it).

        Raises:
            FileNotFoundError: the file is missing.
            ValueError: a key is missing or out of range (message names file and key).
        """
        path = Path(checkpoint_dir) / "generation_config.json"
        with path.open(encoding="utf-8") as file:
            config = json.load(file)
        try:
            defaults = cls(
                do_sample=bool(config["do_sample"]),
                temperature=float(config["temperature"]),
                top_k=int(config["top_k"]),
                top_p=float(config["top_p"]),
                repetition_penalty=float(config["repetition_penalty"]),
                subtalker_do_sample=bool(config["subtalker_dosample"]),
                subtalker_temperature=float(config["subtalker_temperature"]),
                subtalker_top_k=int(config["subtalker_top_k"]),
                subtalker_top_p=float(config["subtalker_top_p"]),
                max_new_tokens=int(config["max_new_tokens"]),
            )
        except KeyError as exc:
            raise ValueError(f"{path}: missing key {exc}") from None
        if not 1 <= defaults.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(f"{path}: max_new_tokens must be 1..{MAX_NEW_TOKENS_LIMIT}")
        try:  # the sampler's own range checks, at load time rather than per request
            SamplingParams(
                temperature=defaults.temperature,
                top_k=defaults.top_k,
                top_p=defaults.top_p,
                repetition_penalty=defaults.repetition_penalty,
            )
            SamplingParams(
                temperature=defaults.subtalker_temperature,
                top_k=defaults.subtalker_top_k,
                top_p=defaults.subtalker_top_p,
            )
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        return defaults


def qwen3_tts_capabilities(
    facts: Qwen3TTSModelFacts, model_names: tuple[str, ...]
) -> SpeechCapabilities:
    """The server-side declaration of what ``facts``' model accepts (module docstring).

    Sampling fields, ``non_streaming_mode`` and ``initial_codec_chunk_frames`` are request
    fields (not ``extra_generation_params``: those carry floats, and these are typed ints
    and bools already in :class:`~omnistage.serve.protocol.SpeechRequest`). ``speed`` is
    not supported (the model has no duration control).
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
        default_voice=None if facts.model_type == "custom_voice" else DEFAULT_VOICE,
        languages=facts.languages,
        task_types=(facts.task_type,),
        sample_rate=SAMPLE_RATE,
        max_input_chars=MAX_INPUT_CHARS,
        response_formats=RESPONSE_FORMATS,
        stream_response_formats=RESPONSE_FORMATS,
        extra_generation_params={"min_new_tokens": (0, MAX_NEW_TOKENS_LIMIT)},
    )
