"""Typed view of a Qwen3-TTS 12 Hz speech tokenizer's ``speech_tokenizer/config.json``.

Layout (``architectures: ["Qwen3TTSTokenizerV2Model"]``, ``model_type:
"qwen3_tts_tokenizer_12hz"``): top-level rates and the number of valid quantizers, an
``encoder_config`` that is a plain Mimi config (kept as a dict and handed to
``transformers.MimiConfig``), and a ``decoder_config`` parsed here into
:class:`DecoderConfig`. Field names and defaults follow the released checkpoint's file
(shared/reference/qwen3-tts.md, section 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.engine.causal_vocoder import VocoderConfig

ARCHITECTURE = "Qwen3TTSTokenizerV2Model"
MODEL_TYPE = "qwen3_tts_tokenizer_12hz"


@dataclass(frozen=True, slots=True)
class DecoderConfig(VocoderConfig):
    """The decoder's dimensions: :class:`~omnistage.engine.causal_vocoder.VocoderConfig`'s
    (the real checkpoint's values as defaults) and (real values in brackets):

    Attributes:
        codebook_size: entries per codebook [2048].
        codebook_dim: width of the summed quantizer output [512]; each codebook holds
            vectors of ``codebook_dim // 2`` [256].
        attention_bias: q/k/v/o projections have biases [False].
        hidden_act: SwiGLU activation ["silu"].
    """

    codebook_size: int = 2048
    codebook_dim: int = 512
    attention_bias: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DecoderConfig:
        """Parse ``decoder_config``; unknown keys (e.g. ``semantic_codebook_size``) are
        ignored, missing ones take the real checkpoint's values.

        Raises:
            ValueError: ``hidden_act`` is not ``"silu"`` or ``attention_bias`` is set (this
                implementation has neither).
        """
        names = set(cls.__dataclass_fields__)
        values = {k: v for k, v in raw.items() if k in names}
        for key in ("upsample_rates", "upsampling_ratios"):
            if key in values:
                values[key] = tuple(int(v) for v in values[key])
        if "head_dim" not in values and "hidden_size" in values:
            # the reference's rule when the file has no head_dim
            values["head_dim"] = values["hidden_size"] // values.get("num_attention_heads", 16)
        config = cls(**values)
        if config.hidden_act != "silu" or config.attention_bias:
            raise ValueError("speech tokenizer decoder: only hidden_act 'silu' without attention bias is supported")
        return config


@dataclass(frozen=True, slots=True)
class SpeechTokenizerConfig:
    """The whole ``speech_tokenizer/config.json``.

    Attributes:
        encoder: the Mimi encoder's config, verbatim (build with ``MimiConfig(**encoder)``).
        decoder: the decoder's dimensions.
        encoder_valid_num_quantizers: code groups kept from the encoder's 32 [16].
        input_sample_rate / output_sample_rate: Hz [24000].
        encode_downsample_rate / decode_upsample_rate: samples per frame [1920].
    """

    encoder: dict[str, Any]
    decoder: DecoderConfig
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    encode_downsample_rate: int = 1920
    decode_upsample_rate: int = 1920

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeechTokenizerConfig:
        """Parse the file's content.

        Raises:
            ValueError: another architecture, or rates that disagree with the decoder's
                upsampling (``decode_upsample_rate`` must equal the product of its strides).
        """
        if ARCHITECTURE not in (raw.get("architectures") or [ARCHITECTURE]):
            raise ValueError(f"not a {ARCHITECTURE} config: architectures={raw.get('architectures')}")
        config = cls(
            encoder=dict(raw.get("encoder_config") or {}),
            decoder=DecoderConfig.from_dict(raw.get("decoder_config") or {}),
            encoder_valid_num_quantizers=int(raw.get("encoder_valid_num_quantizers", 16)),
            input_sample_rate=int(raw.get("input_sample_rate", 24000)),
            output_sample_rate=int(raw.get("output_sample_rate", 24000)),
            encode_downsample_rate=int(raw.get("encode_downsample_rate", 1920)),
            decode_upsample_rate=int(raw.get("decode_upsample_rate", 1920)),
        )
        if config.decode_upsample_rate != config.decoder.samples_per_frame:
            raise ValueError(
                f"decode_upsample_rate {config.decode_upsample_rate} != product of the decoder's "
                f"strides {config.decoder.samples_per_frame}"
            )
        return config

    @classmethod
    def load(cls, directory: str | Path) -> SpeechTokenizerConfig:
        """Read ``directory/config.json`` (the ``speech_tokenizer`` folder).

        Raises:
            FileNotFoundError: no config.json there.
            ValueError: see :meth:`from_dict`.
        """
        return cls.from_dict(json.loads((Path(directory) / "config.json").read_text()))
