"""Piper model code: text preparation, phonemization and batched ONNX synthesis.

Pure model code without pipeline wiring: :mod:`.text` normalizes and splits request text,
:mod:`.voice` loads a voice, phonemizes sentences and synthesizes batches of them.
"""

from omnistage.models.piper.modeling.text import normalize_text, split_sentences
from omnistage.models.piper.modeling.voice import (
    MAX_SPEED,
    MIN_SPEED,
    PiperPhonemizer,
    PiperSynthesizer,
    PiperVoiceSpec,
    SynthesisItem,
    default_voice_path,
    length_scale_for_speed,
    load_voice_spec,
)

__all__ = [
    "MAX_SPEED",
    "MIN_SPEED",
    "PiperPhonemizer",
    "PiperSynthesizer",
    "PiperVoiceSpec",
    "SynthesisItem",
    "default_voice_path",
    "length_scale_for_speed",
    "load_voice_spec",
    "normalize_text",
    "split_sentences",
]
