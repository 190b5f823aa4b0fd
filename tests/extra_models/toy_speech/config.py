"""The toy model's ``EntryClass``: everything the framework derives from it (request
schema, voices, pipeline, sample requests, random-checkpoint writer) is declared here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Self

from pydantic import Field

from omnistage.config.pipeline import FactoryConfig, StageConfig
from omnistage.serve.media import MediaPolicy
from omnistage.serve.model import RandomCheckpoint, SpeechModelConfig
from omnistage.serve.protocol import SpeechCapabilities, SpeechRequest
from tests.extra_models.toy_speech.random_checkpoint import ARCHITECTURE, SIZES
from tests.extra_models.toy_speech.stages import SAMPLE_RATE, ToySpeechRequest

_HERE = "tests.extra_models.toy_speech"


class ToySpeechSpeechRequest(SpeechRequest):
    """``POST /v1/audio/speech`` for the toy model: the framework's fields plus two."""

    pitch_shift: float = Field(default=0.0, ge=-12.0, le=12.0, description="semitones")
    brightness: float = Field(default=0.5, ge=0.0, le=1.0, description="weight of the upper harmonics")


class ToySpeechConfig(SpeechModelConfig):
    architecture = ARCHITECTURE
    speech_request = ToySpeechSpeechRequest
    random_checkpoint = RandomCheckpoint(writer=f"{_HERE}.random_checkpoint:write_toy_checkpoint", sizes=SIZES)

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        _voices(model_path)  # fail now, naming the file, if unusable
        return cls(
            name=f"toy_speech:{Path(model_path).name}",
            model_path=model_path,
            stages=[
                StageConfig(
                    name="score",
                    factory=FactoryConfig(path=f"{_HERE}.stages:create_score_stage"),
                    next="synth",
                    result_type=f"{_HERE}.stages:Score",
                ),
                StageConfig(
                    name="synth",
                    factory=FactoryConfig(path=f"{_HERE}.stages:create_synth_stage"),
                    terminal=True,
                    payload_type=f"{_HERE}.stages:Score",
                    result_type="omnistage.core.payloads:AudioResult",
                    stream_types=["omnistage.core.payloads:AudioChunk"],
                ),
            ],
        )

    def capabilities(self) -> SpeechCapabilities:
        assert self.model_path is not None
        voices = tuple(_voices(self.model_path))
        return SpeechCapabilities(
            model_names=(Path(self.model_path).name, "toy-speech"),
            model_type="toy_speech",
            supported_fields=frozenset({"voice", "pitch_shift", "brightness"}),
            voices=voices,
            default_voice=voices[0],
            sample_rate=SAMPLE_RATE,
            response_formats=frozenset({"wav", "pcm"}),
        )

    def build_request(self, request: ToySpeechSpeechRequest, media: MediaPolicy) -> ToySpeechRequest:
        assert self.model_path is not None
        voice = request.voice or self.capabilities().default_voice
        return ToySpeechRequest(request.input, _voices(self.model_path)[voice], request.pitch_shift, request.brightness)

    def sample_requests(self) -> list[ToySpeechSpeechRequest]:
        return [ToySpeechSpeechRequest(input="Hi.", pitch_shift=2.0)]


def _voices(model_path: str) -> dict[str, float]:
    """Raises: FileNotFoundError / ValueError naming ``config.json``."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    if not config.get("voices"):
        raise ValueError(f"{model_path}/config.json declares no voices")
    return config["voices"]


EntryClass = ToySpeechConfig
