"""Typed parse of a Qwen3-TTS checkpoint's ``config.json`` and ``generation_config.json``:
the one place the package reads them (the server's capabilities are derived from these
types, :mod:`omnistage.models.qwen3_tts.capabilities`).

Only 12 Hz checkpoints (``tokenizer_type`` ``qwen3_tts_tokenizer_12hz``) of the
``Qwen3TTSForConditionalGeneration`` architecture are accepted. Every field the model's
shapes or token ids depend on is read from the file and a missing one is an error: the
reference's config classes carry defaults that are wrong for the 12 Hz checkpoints (codec
ids 4196.., 32 code groups, talker ``head_dim`` falling back to hidden/heads = 64 instead of
128; digest section 8). The only defaults kept are the speaker encoder's ECAPA-TDNN
geometry, which real checkpoints leave out and which the reference takes from its class
defaults (digest section 7). Speaker and language names are lower-cased, as the reference
does before looking them up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omnistage.checkpoint.config_json import CheckpointConfigError, load_json, require
from omnistage.engine.layers import CodePredictorConfig, DecoderConfig
from omnistage.engine.sampler import SamplingParams

__all__ = [
    "ARCHITECTURE",
    "CONFIG_FILE",
    "GENERATION_CONFIG_FILE",
    "MAX_NEW_TOKENS_LIMIT",
    "TOKENIZER_TYPE",
    "CheckpointConfigError",
    "CodePredictorConfig",
    "DecoderConfig",
    "GenerationConfig",
    "ModelType",
    "Qwen3TTSConfig",
    "SpeakerEncoderConfig",
    "TalkerConfig",
    "load_config",
    "load_generation_config",
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
ARCHITECTURE = "Qwen3TTSForConditionalGeneration"
TOKENIZER_TYPE = "qwen3_tts_tokenizer_12hz"
MAX_NEW_TOKENS_LIMIT = 8192
"""Highest frame cap, in generation_config.json or a request: the shipped checkpoints'
``max_new_tokens`` (655 s of audio at 12.5 frames/s)."""
ModelType = Literal["base", "custom_voice", "voice_design"]
_SHIPPED = " (every Qwen3-TTS checkpoint ships one)"


def _parse_decoder(section: dict[str, Any], where: str) -> DecoderConfig:
    """Raises: CheckpointConfigError on a missing field, a non-SiLU activation, sliding
    window attention, or heads that do not group (num_heads % num_kv_heads != 0)."""
    def req(key: str, kind: Callable[[Any], Any] | None = None) -> Any:
        return require(section, key, where, kind)

    if req("hidden_act") != "silu":
        raise CheckpointConfigError(f"{where}.hidden_act is {section['hidden_act']!r}; only 'silu' is supported")
    if section.get("use_sliding_window", False):
        raise CheckpointConfigError(f"{where}.use_sliding_window is set; Qwen3-TTS uses full attention")
    config = DecoderConfig(
        hidden_size=req("hidden_size", int),
        intermediate_size=req("intermediate_size", int),
        num_layers=req("num_hidden_layers", int),
        num_heads=req("num_attention_heads", int),
        num_kv_heads=req("num_key_value_heads", int),
        head_dim=req("head_dim", int),
        rms_norm_eps=req("rms_norm_eps", float),
        rope_theta=req("rope_theta", float),
        vocab_size=req("vocab_size", int),
        attention_bias=bool(section.get("attention_bias", False)),
    )
    if config.num_heads % config.num_kv_heads:
        raise CheckpointConfigError(f"{where}: {config.num_heads} heads do not group over {config.num_kv_heads} kv heads")
    return config


@dataclass(frozen=True)
class TalkerConfig:
    """The talker: decoder geometry, text track, codec special ids, languages and speakers.

    Attributes:
        spk_id: speaker name (lower case) -> codec id (CustomVoice; empty otherwise). The file
            stores an int or a 1-element list per speaker.
        spk_is_dialect: speaker -> dialect language name (``None`` = not a dialect speaker).
        codec_language_id: language name -> codec id (dialects included).
        mrope_section, mrope_interleaved: the file's rope_scaling. All three position rows
            are equal for TTS, so the multimodal RoPE is plain 1-D RoPE (tested against the
            reference on random weights).
    """

    decoder: DecoderConfig
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_language_id: dict[str, int]
    spk_id: dict[str, int]
    spk_is_dialect: dict[str, str | None]
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """ECAPA-TDNN geometry. Defaults are the real checkpoints' values (the reference's class
    defaults, which the shipped config.json relies on: it stores only enc_dim and
    sample_rate)."""

    enc_dim: int
    sample_rate: int
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128


@dataclass(frozen=True)
class Qwen3TTSConfig:
    """The whole ``config.json``.

    ``speaker_encoder`` is ``None`` unless ``tts_model_type == "base"`` (CustomVoice and
    VoiceDesign checkpoints carry no speaker encoder weights).
    """

    tts_model_type: ModelType
    tts_model_size: str
    tokenizer_type: str
    im_start_id: int
    im_end_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    talker: TalkerConfig
    code_predictor: CodePredictorConfig
    speaker_encoder: SpeakerEncoderConfig | None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen3TTSConfig:
        """Raises: CheckpointConfigError naming the field: one is missing or malformed,
        ``architectures`` lacks :data:`ARCHITECTURE`, ``tokenizer_type`` is not the 12 Hz
        :data:`TOKENIZER_TYPE` (the 25 Hz tokenizer is another codec), or a CustomVoice
        model has no speakers."""
        def req(key: str, kind: Callable[[Any], Any] | None = None) -> Any:
            return require(raw, key, "", kind)

        architectures = req("architectures")
        if not isinstance(architectures, list) or ARCHITECTURE not in architectures:
            raise CheckpointConfigError(f"architectures {architectures!r} lack {ARCHITECTURE!r}")
        tokenizer_type = req("tokenizer_type", str)
        if tokenizer_type != TOKENIZER_TYPE:
            raise CheckpointConfigError(f"tokenizer_type {tokenizer_type!r} is not {TOKENIZER_TYPE!r}")
        model_type = req("tts_model_type")
        if model_type not in ("base", "custom_voice", "voice_design"):
            raise CheckpointConfigError(f"tts_model_type {model_type!r} is not base, custom_voice or voice_design")
        talker_raw = req("talker_config")
        predictor_raw = require(talker_raw, "code_predictor_config", "talker_config")
        talker = _parse_talker(talker_raw)
        if model_type == "custom_voice" and not talker.spk_id:
            raise CheckpointConfigError("talker_config.spk_id is empty; a custom_voice model needs speakers")
        speaker = None
        if model_type == "base":
            speaker = _parse_speaker_encoder(req("speaker_encoder_config"))
        where = "talker_config.code_predictor_config"
        return cls(
            tts_model_type=model_type,
            tts_model_size=req("tts_model_size", str),
            tokenizer_type=tokenizer_type,
            im_start_id=req("im_start_token_id", int),
            im_end_id=req("im_end_token_id", int),
            tts_pad_id=req("tts_pad_token_id", int),
            tts_bos_id=req("tts_bos_token_id", int),
            tts_eos_id=req("tts_eos_token_id", int),
            talker=talker,
            code_predictor=CodePredictorConfig(
                decoder=_parse_decoder(predictor_raw, where),
                num_code_groups=require(predictor_raw, "num_code_groups", where, int),
            ),
            speaker_encoder=speaker,
        )


def _codec_id(value: Any, field: str) -> int:
    """A codec id given as an int or a one-element list (both occur in shipped configs)."""
    ids = value if isinstance(value, list) else [value]
    if len(ids) != 1 or not isinstance(ids[0], int) or isinstance(ids[0], bool):
        raise CheckpointConfigError(f"{field} must be an int or a 1-element list, got {value!r}")
    return ids[0]


def _parse_talker(raw: dict[str, Any]) -> TalkerConfig:
    where = "talker_config"

    def req(key: str, kind: Callable[[Any], Any] | None = None) -> Any:
        return require(raw, key, where, kind)

    decoder = _parse_decoder(raw, where)
    rope = req("rope_scaling")
    section = tuple(int(x) for x in require(rope, "mrope_section", "talker_config.rope_scaling"))
    if sum(section) != decoder.head_dim // 2:
        raise CheckpointConfigError(f"talker mrope_section {section} does not sum to head_dim/2 = {decoder.head_dim // 2}")
    spk_id = {name.lower(): _codec_id(value, f"talker_config.spk_id.{name}") for name, value in dict(req("spk_id") or {}).items()}
    dialects = {name.lower(): (value or None) for name, value in dict(req("spk_is_dialect") or {}).items()}
    languages = {
        name.lower(): _codec_id(value, f"talker_config.codec_language_id.{name}")
        for name, value in dict(req("codec_language_id")).items()
    }
    for speaker, dialect in dialects.items():
        if dialect is not None and (speaker not in spk_id or dialect not in languages):
            raise CheckpointConfigError(f"talker_config.spk_is_dialect.{speaker} = {dialect!r} names no speaker or no language")
    return TalkerConfig(
        decoder=decoder,
        text_vocab_size=req("text_vocab_size", int),
        text_hidden_size=req("text_hidden_size", int),
        num_code_groups=req("num_code_groups", int),
        codec_eos_id=req("codec_eos_token_id", int),
        codec_think_id=req("codec_think_id", int),
        codec_nothink_id=req("codec_nothink_id", int),
        codec_think_bos_id=req("codec_think_bos_id", int),
        codec_think_eos_id=req("codec_think_eos_id", int),
        codec_pad_id=req("codec_pad_id", int),
        codec_bos_id=req("codec_bos_id", int),
        codec_language_id=languages,
        spk_id=spk_id,
        spk_is_dialect=dialects,
        mrope_section=section,
        mrope_interleaved=bool(rope.get("interleaved", False)),
    )


def _parse_speaker_encoder(raw: dict[str, Any]) -> SpeakerEncoderConfig:
    where = "speaker_encoder_config"
    optional = {}
    for key in ("mel_dim", "enc_attention_channels", "enc_res2net_scale", "enc_se_channels"):
        if key in raw:
            optional[key] = require(raw, key, where, int)
    for key in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
        if key in raw:
            optional[key] = tuple(int(x) for x in raw[key])
    config = SpeakerEncoderConfig(
        enc_dim=require(raw, "enc_dim", where, int),
        sample_rate=require(raw, "sample_rate", where, int),
        **optional,
    )
    if not len(config.enc_channels) == len(config.enc_kernel_sizes) == len(config.enc_dilations):
        raise CheckpointConfigError(f"{where}: enc_channels, enc_kernel_sizes and enc_dilations differ in length")
    return config


_SAMPLER_KEYS = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
    "repetition_penalty": "repetition_penalty", "subtalker_temperature": "temperature",
    "subtalker_top_k": "top_k", "subtalker_top_p": "top_p",
}  # fmt: skip
"""generation_config.json key -> the :class:`SamplingParams` field whose range it has."""


@dataclass(frozen=True)
class GenerationConfig:
    """``generation_config.json``: talker sampling, code-predictor ("subtalker") sampling and
    the length cap; the sampling used where a request sets nothing. Values of the shipped
    checkpoints: do_sample true, top_k 50, top_p 1.0, temperature 0.9, repetition_penalty
    1.05, subtalker_* the same without penalty, max_new_tokens 8192 (digest section 1).

    Ranges (checked by :meth:`from_dict`, the sampler's own): temperatures >= 0, top_k >= 0,
    top_p in (0, 1], repetition_penalty > 0, floats within float32; max_new_tokens
    1..:data:`MAX_NEW_TOKENS_LIMIT` frames.
    """

    do_sample: bool
    top_k: int
    top_p: float
    temperature: float
    repetition_penalty: float
    subtalker_dosample: bool
    subtalker_top_k: int
    subtalker_top_p: float
    subtalker_temperature: float
    max_new_tokens: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationConfig:
        """Raises: CheckpointConfigError naming the first key that is missing, malformed or
        out of range (so a bad default fails at load, not in every request that uses it)."""
        def req(key: str, kind: Callable[[Any], Any]) -> Any:
            return require(raw, key, "", kind)

        config = cls(
            do_sample=req("do_sample", bool),
            top_k=req("top_k", int),
            top_p=req("top_p", float),
            temperature=req("temperature", float),
            repetition_penalty=req("repetition_penalty", float),
            subtalker_dosample=req("subtalker_dosample", bool),
            subtalker_top_k=req("subtalker_top_k", int),
            subtalker_top_p=req("subtalker_top_p", float),
            subtalker_temperature=req("subtalker_temperature", float),
            max_new_tokens=req("max_new_tokens", int),
        )
        if not 1 <= config.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise CheckpointConfigError(f"max_new_tokens = {config.max_new_tokens} is not in 1..{MAX_NEW_TOKENS_LIMIT}")
        for key, field in _SAMPLER_KEYS.items():
            value = getattr(config, key)
            try:
                SamplingParams(**{field: value})
            except ValueError as exc:
                raise CheckpointConfigError(f"{key} = {value!r} is out of range ({exc})") from None
        return config


def load_config(checkpoint_dir: str | Path) -> Qwen3TTSConfig:
    """Parse ``<checkpoint_dir>/config.json``.

    Raises: CheckpointConfigError (a ValueError) naming the file and the field:
    :meth:`Qwen3TTSConfig.from_dict` lists the checks.
    """
    return load_json(Path(checkpoint_dir) / CONFIG_FILE, Qwen3TTSConfig.from_dict, _SHIPPED)


def load_generation_config(checkpoint_dir: str | Path) -> GenerationConfig:
    """Parse ``<checkpoint_dir>/generation_config.json`` (mandatory, as in the reference
    loader). Raises: CheckpointConfigError naming the file and the key that is missing,
    malformed or out of range (:class:`GenerationConfig`)."""
    return load_json(Path(checkpoint_dir) / GENERATION_CONFIG_FILE, GenerationConfig.from_dict, _SHIPPED)
