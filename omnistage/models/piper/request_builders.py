"""Speech request -> :class:`PiperRequest`: all validation before any synthesis."""

from __future__ import annotations

from pydantic import Field

from omnistage.core.errors import RequestValidationError
from omnistage.models.piper.modeling import (
    PiperVoiceSpec,
    check_speed,
    normalize_text,
    split_sentences,
)
from omnistage.models.piper.payload_types import PiperRequest
from omnistage.serve.protocol import SpeechRequest

MAX_SENTENCE_CHARS = 400  # longer sentences are split at commas/spaces (latency of the first chunk)


class PiperSpeechRequest(SpeechRequest):
    """``POST /v1/audio/speech`` for a Piper voice: the framework's fields plus the VITS
    noise scales (null: the voice's own, from its ``.onnx.json``; 0 makes the output
    deterministic)."""

    noise_scale: float | None = Field(default=None, ge=0.0, le=2.0, description="VITS noise scale")
    noise_w: float | None = Field(default=None, ge=0.0, le=2.0, description="VITS duration noise")


def voice_names(spec: PiperVoiceSpec) -> tuple[str, ...]:
    """Voice names a request may use: the speakers of a multi-speaker voice, else the
    voice's short name (``en_US-joe-medium`` -> ``joe``, Piper's naming convention)."""
    if spec.speaker_names:
        return spec.speaker_names
    parts = spec.onnx_path.stem.split("-")
    return (parts[1] if len(parts) == 3 else spec.onnx_path.stem,)


def build_piper_request(request: PiperSpeechRequest, spec: PiperVoiceSpec) -> PiperRequest:
    """Raises: RequestValidationError naming the field (input, speed, voice)."""
    sentences = tuple(split_sentences(normalize_text(request.input), MAX_SENTENCE_CHARS))
    speaker_id = None
    if spec.speaker_names and request.voice is not None:
        if request.voice not in spec.speaker_names:
            raise RequestValidationError(f"unknown voice {request.voice!r}", param="voice")
        speaker_id = spec.speaker_names.index(request.voice)
    return PiperRequest(
        sentences=sentences,
        length_scale=spec.length_scale,
        speed=check_speed(request.speed),
        noise_scale=spec.noise_scale if request.noise_scale is None else request.noise_scale,
        noise_w=spec.noise_w if request.noise_w is None else request.noise_w,
        speaker_id=speaker_id,
    )
