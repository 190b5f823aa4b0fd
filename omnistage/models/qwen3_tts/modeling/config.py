"""Typed parse of a Qwen3-TTS checkpoint's ``config.json`` and ``generation_config.json``.

Every field the model's shapes or token ids depend on is read from the file and a missing
one is an error: the reference's config classes carry defaults that are wrong for the 12 Hz
checkpoints (codec ids 4196.., 32 code groups, talker ``head_dim`` falling back to
hidden/heads = 64 instead of 128; digest section 8). The only defaults kept are the speaker
encoder's ECAPA-TDNN geometry, which real checkpoints leave out and which the reference
takes from its class defaults (digest section 7).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CONFIG_FILE",
    "GENERATION_CONFIG_FILE",
    "CheckpointConfigError",
    "CodePredictorConfig",
    "DecoderConfig",
    "GenerationConfig",
    "Qwen3TTSConfig",
    "SpeakerEncoderConfig",
    "TalkerConfig",
    "load_config",
    "load_generation_config",
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
ModelType = Literal["base", "custom_voice", "voice_design"]


class CheckpointConfigError(ValueError):
    """A checkpoint's config file is missing, unreadable, or lacks a required field."""


def _require(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise CheckpointConfigError(f"{where} has no {key!r}")
    return section[key]


@dataclass(frozen=True)
class DecoderConfig:
    """Geometry of one Qwen3 decoder stack (talker or code predictor).

    ``head_dim`` is explicit: the 0.6B talker has hidden 1024 and 16 heads but head_dim 128.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    attention_bias: bool

    @classmethod
    def parse(cls, section: dict[str, Any], where: str) -> DecoderConfig:
        """Raises: CheckpointConfigError on a missing field, a non-SiLU activation, sliding
        window attention, or heads that do not group (num_heads % num_kv_heads != 0)."""
        def req(key: str) -> Any:
            return _require(section, key, where)

        if req("hidden_act") != "silu":
            raise CheckpointConfigError(f"{where}.hidden_act is {section['hidden_act']!r}; only 'silu' is supported")
        if section.get("use_sliding_window", False):
            raise CheckpointConfigError(f"{where}.use_sliding_window is set; Qwen3-TTS uses full attention")
        config = cls(
            hidden_size=int(req("hidden_size")),
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=int(req("num_attention_heads")),
            num_kv_heads=int(req("num_key_value_heads")),
            head_dim=int(req("head_dim")),
            rms_norm_eps=float(req("rms_norm_eps")),
            rope_theta=float(req("rope_theta")),
            vocab_size=int(req("vocab_size")),
            attention_bias=bool(section.get("attention_bias", False)),
        )
        if config.num_heads % config.num_kv_heads:
            raise CheckpointConfigError(f"{where}: {config.num_heads} heads do not group over {config.num_kv_heads} kv heads")
        return config


@dataclass(frozen=True)
class CodePredictorConfig:
    """The per-frame code predictor: a Qwen3 decoder plus ``num_code_groups - 1`` codec
    embeddings and lm heads (groups 1..15)."""

    decoder: DecoderConfig
    num_code_groups: int


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
        """Raises: CheckpointConfigError on a missing or invalid field."""
        model_type = _require(raw, "tts_model_type", CONFIG_FILE)
        if model_type not in ("base", "custom_voice", "voice_design"):
            raise CheckpointConfigError(f"tts_model_type {model_type!r} is not base, custom_voice or voice_design")
        talker_raw = _require(raw, "talker_config", CONFIG_FILE)
        predictor_raw = _require(talker_raw, "code_predictor_config", "talker_config")
        speaker = None
        if model_type == "base":
            speaker = _parse_speaker_encoder(_require(raw, "speaker_encoder_config", CONFIG_FILE))
        return cls(
            tts_model_type=model_type,
            tts_model_size=str(_require(raw, "tts_model_size", CONFIG_FILE)),
            tokenizer_type=str(_require(raw, "tokenizer_type", CONFIG_FILE)),
            im_start_id=int(_require(raw, "im_start_token_id", CONFIG_FILE)),
            im_end_id=int(_require(raw, "im_end_token_id", CONFIG_FILE)),
            tts_pad_id=int(_require(raw, "tts_pad_token_id", CONFIG_FILE)),
            tts_bos_id=int(_require(raw, "tts_bos_token_id", CONFIG_FILE)),
            tts_eos_id=int(_require(raw, "tts_eos_token_id", CONFIG_FILE)),
            talker=_parse_talker(talker_raw),
            code_predictor=CodePredictorConfig(
                decoder=DecoderConfig.parse(predictor_raw, "code_predictor_config"),
                num_code_groups=int(_require(predictor_raw, "num_code_groups", "code_predictor_config")),
            ),
            speaker_encoder=speaker,
        )


def _parse_talker(raw: dict[str, Any]) -> TalkerConfig:
    where = "talker_config"

    def req(key: str) -> Any:
        return _require(raw, key, where)

    decoder = DecoderConfig.parse(raw, where)
    rope = req("rope_scaling")
    section = tuple(int(x) for x in _require(rope, "mrope_section", "talker_config.rope_scaling"))
    if sum(section) != decoder.head_dim // 2:
        raise CheckpointConfigError(f"talker mrope_section {section} does not sum to head_dim/2 = {decoder.head_dim // 2}")
    spk_id = {}
    for name, value in dict(req("spk_id") or {}).items():
        ids = value if isinstance(value, list) else [value]
        if len(ids) != 1:
            raise CheckpointConfigError(f"talker_config.spk_id[{name!r}] must be an int or a 1-element list, got {value!r}")
        spk_id[name.lower()] = int(ids[0])
    dialects = {name.lower(): (value or None) for name, value in dict(req("spk_is_dialect") or {}).items()}
    languages = {name.lower(): int(value) for name, value in dict(req("codec_language_id")).items()}
    for speaker, dialect in dialects.items():
        if dialect is not None and dialect not in languages:
            raise CheckpointConfigError(f"speaker {speaker!r} maps to dialect {dialect!r}, which codec_language_id lacks")
    return TalkerConfig(
        decoder=decoder,
        text_vocab_size=int(req("text_vocab_size")),
        text_hidden_size=int(req("text_hidden_size")),
        num_code_groups=int(req("num_code_groups")),
        codec_eos_id=int(req("codec_eos_token_id")),
        codec_think_id=int(req("codec_think_id")),
        codec_nothink_id=int(req("codec_nothink_id")),
        codec_think_bos_id=int(req("codec_think_bos_id")),
        codec_think_eos_id=int(req("codec_think_eos_id")),
        codec_pad_id=int(req("codec_pad_id")),
        codec_bos_id=int(req("codec_bos_id")),
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
            optional[key] = int(raw[key])
    for key in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
        if key in raw:
            optional[key] = tuple(int(x) for x in raw[key])
    config = SpeakerEncoderConfig(
        enc_dim=int(_require(raw, "enc_dim", where)),
        sample_rate=int(_require(raw, "sample_rate", where)),
        **optional,
    )
    if not len(config.enc_channels) == len(config.enc_kernel_sizes) == len(config.enc_dilations):
        raise CheckpointConfigError(f"{where}: enc_channels, enc_kernel_sizes and enc_dilations differ in length")
    return config


@dataclass(frozen=True)
class GenerationConfig:
    """``generation_config.json``: talker sampling, code-predictor ("subtalker") sampling and
    the length cap. Values of the shipped checkpoints: do_sample true, top_k 50, top_p 1.0,
    temperature 0.9, repetition_penalty 1.05, subtalker_* the same without penalty,
    max_new_tokens 8192 (digest section 1)."""

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
        """Raises: CheckpointConfigError naming the first missing key."""
        def req(key: str) -> Any:
            return _require(raw, key, GENERATION_CONFIG_FILE)

        return cls(
            do_sample=bool(req("do_sample")),
            top_k=int(req("top_k")),
            top_p=float(req("top_p")),
            temperature=float(req("temperature")),
            repetition_penalty=float(req("repetition_penalty")),
            subtalker_dosample=bool(req("subtalker_dosample")),
            subtalker_top_k=int(req("subtalker_top_k")),
            subtalker_top_p=float(req("subtalker_top_p")),
            subtalker_temperature=float(req("subtalker_temperature")),
            max_new_tokens=int(req("max_new_tokens")),
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointConfigError(f"{path.name} is missing from {path.parent} (every Qwen3-TTS checkpoint ships one)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointConfigError(f"{path} cannot be read as JSON: {exc}") from exc


def load_config(checkpoint_dir: str | Path) -> Qwen3TTSConfig:
    """Parse ``<checkpoint_dir>/config.json``. Raises: CheckpointConfigError."""
    return Qwen3TTSConfig.from_dict(_read_json(Path(checkpoint_dir) / CONFIG_FILE))


def load_generation_config(checkpoint_dir: str | Path) -> GenerationConfig:
    """Parse ``<checkpoint_dir>/generation_config.json`` (mandatory, as in the reference
    loader). Raises: CheckpointConfigError naming the missing file or key."""
    return GenerationConfig.from_dict(_read_json(Path(checkpoint_dir) / GENERATION_CONFIG_FILE))
