"""Piper model code: text preparation, phonemization and batched ONNX synthesis.

Pure model code without pipeline wiring: :mod:`.text` normalizes and splits request text,
:mod:`.voice` loads a voice, phonemizes sentences and synthesizes batches of them,
:mod:`.speed` stretches the audio to the requested speaking rate.
"""

from omnistage.models.piper.modeling.speed import MAX_SPEED, MIN_SPEED, change_speed, check_speed
from omnistage.models.piper.modeling.text import normalize_text, split_sentences
from omnistage.models.piper.modeling.voice import (
    MEMORY_ARENAS,
    MemoryArena,
    PiperPhonemizer,
    PiperSynthesizer,
    PiperVoiceSpec,
    SynthesisItem,
    default_voice_path,
    load_voice_spec,
)

__all__ = [
    "MAX_SPEED",
    "MEMORY_ARENAS",
    "MIN_SPEED",
    "MemoryArena",
    "PiperPhonemizer",
    "PiperSynthesizer",
    "PiperVoiceSpec",
    "SynthesisItem",
    "change_speed",
    "check_speed",
    "default_voice_path",
    "load_voice_spec",
    "normalize_text",
    "split_sentences",
]
