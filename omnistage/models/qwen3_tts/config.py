"""The Qwen3-TTS 12 Hz pipeline (0.6B / 1.7B; Base, CustomVoice, VoiceDesign): ``EntryClass``.

``omnistage serve --model-path DIR`` with a checkpoint in the real Hugging Face layout
(``config.json`` ``architectures: ["Qwen3TTSForConditionalGeneration"]``) serves it on
CUDA when available, else on CPU (slow, correct). Stages: see :mod:`.stages`.
"""

from __future__ import annotations

import base64
import io
from functools import lru_cache
from pathlib import Path
from typing import Self

import numpy as np
import soundfile
import torch

from omnistage.config.pipeline import FactoryConfig, StageConfig
from omnistage.core.errors import RequestValidationError
from omnistage.models.qwen3_tts.capabilities import (
    MAX_MODEL_LEN,
    SAMPLE_RATE,
    Qwen3TTSModelFacts,
    qwen3_tts_capabilities,
)
from omnistage.models.qwen3_tts.modeling.config import load_config
from omnistage.models.qwen3_tts.payload_types import Qwen3TTSRequest
from omnistage.models.qwen3_tts.random_checkpoint import SIZES, TYPES
from omnistage.models.qwen3_tts.request_builders import (
    Qwen3TTSSpeechRequest,
    RequestLimits,
    build_qwen3_tts_request,
    load_request_limits,
)
from omnistage.serve.media import MediaPolicy
from omnistage.serve.model import RandomCheckpoint, SpeechModelConfig
from omnistage.serve.protocol import SpeechCapabilities

_STAGES = "omnistage.models.qwen3_tts.stages"
# what the edges carry (omnistage.pipeline.edges)
TALKER_START = "omnistage.models.qwen3_tts.payload_types:TalkerStart"
INPUT_TEXT = "omnistage.core.payloads:InputText"
GENERATION_SUMMARY = "omnistage.scheduling.ar:GenerationSummary"
CODE_FRAMES = "omnistage.scheduling.ar:CodeFrames"
VOCODER_SETUP = "omnistage.scheduling.vocoder:VocoderSetup"
AUDIO_CHUNK = "omnistage.core.payloads:AudioChunk"
AUDIO_RESULT = "omnistage.core.payloads:AudioResult"
ENCODED_REFERENCE = "omnistage.models.qwen3_tts.payload_types:EncodedReference"


class Qwen3TTSPipelineConfig(SpeechModelConfig):
    architecture = "Qwen3TTSForConditionalGeneration"
    speech_request = Qwen3TTSSpeechRequest
    random_checkpoint = RandomCheckpoint(
        writer="omnistage.models.qwen3_tts.random_checkpoint:write_random_checkpoint", sizes=SIZES, types=TYPES
    )

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        facts = _facts(model_path)  # fail now, naming the file and the field, if unusable
        device = "cuda" if torch.cuda.is_available() else "cpu"  # --<stage>.device overrides
        clone = facts.model_type == "base"
        # Base: the reference clips of concurrent requests are encoded as one batch first
        references = [
            StageConfig(
                name="reference_encoder",
                device=device,
                factory=FactoryConfig(
                    path=f"{_STAGES}:create_reference_encoder_stage",
                    args={"max_batch_size": 8, "max_batch_wait_ms": 2.0, "cache_size": 256},
                ),
                next="preprocessing",
                result_type=ENCODED_REFERENCE,
            )
        ] if clone else []
        return cls(
            name=f"qwen3_tts:{Path(model_path).name}",
            model_path=model_path,
            entry_stage="reference_encoder" if clone else "preprocessing",
            stages=[
                # Built first: the vocoder's weights, state arena and CUDA graphs must be
                # resident before the engine sizes its KV pool from the free memory.
                StageConfig(
                    name="vocoder",
                    device=device,
                    factory=FactoryConfig(path=f"{_STAGES}:create_vocoder_stage", args={"num_slots": 64}),
                    terminal=True,
                    # setup and frames stream in while the engine runs; its result comes last
                    can_accept_stream_before_payload=True,
                    payload_type=GENERATION_SUMMARY,
                    accepts_stream_types=[VOCODER_SETUP, CODE_FRAMES],
                    result_type=AUDIO_RESULT,
                    stream_types=[AUDIO_CHUNK],
                ),
                *references,
                StageConfig(
                    name="preprocessing",
                    device=device,
                    factory=FactoryConfig(path=f"{_STAGES}:create_preprocessing_stage", args={"max_batch_size": 64}),
                    next="tts_engine",
                    stream_to=["vocoder"],
                    payload_type=ENCODED_REFERENCE if clone else None,
                    result_type=TALKER_START,
                    stream_types=[VOCODER_SETUP],
                ),
                StageConfig(
                    name="tts_engine",
                    device=device,
                    factory=FactoryConfig(
                        path=f"{_STAGES}:create_tts_engine_stage",
                        args={"mem_fraction_static": 0.5},
                    ),
                    next="vocoder",
                    stream_to=["vocoder"],
                    # a live request's text comes from its client while it runs, and
                    # may come before preprocessing is done with its prompt
                    accepts_client_input=[INPUT_TEXT],
                    can_accept_stream_before_payload=True,
                    payload_type=TALKER_START,
                    result_type=GENERATION_SUMMARY,
                    stream_types=[CODE_FRAMES],
                ),
            ],
        )

    def _facts(self) -> Qwen3TTSModelFacts:
        assert self.model_path is not None
        return _facts(self.model_path)

    def capabilities(self) -> SpeechCapabilities:
        assert self.model_path is not None
        return qwen3_tts_capabilities(self._facts(), (Path(self.model_path).name, "qwen3-tts"))

    def build_request(self, request: Qwen3TTSSpeechRequest, media: MediaPolicy) -> Qwen3TTSRequest:
        return build_qwen3_tts_request(request, self._facts(), media, self._limits())

    def _limits(self) -> RequestLimits:
        """The limits of this pipeline: the checkpoint's and its ``tts_engine`` stage's
        ``max_model_len`` (the factory's default unless the config sets it)."""
        assert self.model_path is not None
        max_model_len = self.stage("tts_engine").factory.args.get("max_model_len", MAX_MODEL_LEN)
        return _limits(self.model_path, int(max_model_len))

    def build_live_request(self, request: Qwen3TTSSpeechRequest, media: MediaPolicy) -> Qwen3TTSRequest:
        """``request`` whose text continues while it runs, fed one token per frame (streaming
        text mode; ``non_streaming_mode: true`` is a 400)."""
        return build_qwen3_tts_request(request, self._facts(), media, self._limits(), more_text=True)

    def with_saved_voice(
        self, request: Qwen3TTSSpeechRequest, audio: str, ref_text: str | None
    ) -> Qwen3TTSSpeechRequest:
        """Base: the saved clip as ``ref_audio``; its transcript as ``ref_text`` (ICL), or
        ``x_vector_only_mode`` when it has none or the request sets it (the speaker
        embedding of the clip alone).

        Raises:
            RequestValidationError: the request also sends ``ref_audio`` or
                ``references`` (``param="voice"``), or ``ref_text`` (the saved voice's
                transcript is its own; ``param="ref_text"``).
        """
        if request.ref_audio is not None or request.references:
            raise RequestValidationError(
                f"voice {request.voice!r} is a saved voice; send it or ref_audio/references, not both",
                param="voice",
            )
        if request.ref_text is not None:
            raise RequestValidationError(
                f"voice {request.voice!r} is a saved voice with its own transcript (or none); omit ref_text",
                param="ref_text",
            )
        x_vector = request.x_vector_only_mode or ref_text is None
        clone = {"ref_audio": audio, "ref_text": None if x_vector else ref_text, "x_vector_only_mode": x_vector}
        return request.model_copy(update={**clone, "voice": None})

    def sample_requests(self) -> list[Qwen3TTSSpeechRequest]:
        """A 4-frame request valid for the checkpoint's type (Base: an ICL clone of a 1 s
        synthetic clip, so the reference encoders and the vocoder's left-context path are
        warm before the first real clone)."""
        facts = self._facts()
        fields: dict = {"input": "Hello.", "max_new_tokens": 4}
        if facts.model_type == "custom_voice":
            fields["voice"] = facts.voices[0]
        elif facts.model_type == "voice_design":
            fields["instructions"] = "A calm, clear voice."
        else:
            fields["ref_audio"] = _warmup_clip()
            fields["ref_text"] = "Hello."
        return [Qwen3TTSSpeechRequest(**fields)]


@lru_cache(maxsize=8)
def _limits(model_path: str, max_model_len: int) -> RequestLimits:
    """Loaded once per model path and limit (the tokenizer, a few MB); every request's build
    uses it. Raises: CheckpointConfigError, OSError (:func:`load_request_limits`)."""
    return load_request_limits(model_path, max_model_len)


@lru_cache(maxsize=8)
def _facts(model_path: str) -> Qwen3TTSModelFacts:
    """Read once per model path: capabilities, every request's build and the warm-up use it.
    Raises: CheckpointConfigError naming the file and the field."""
    return Qwen3TTSModelFacts.from_config(load_config(model_path))


def _warmup_clip() -> str:
    """1 s of a decaying 220 Hz tone as a WAV data URI."""
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) * np.exp(-2 * t)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, SAMPLE_RATE, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


EntryClass = Qwen3TTSPipelineConfig
