"""The Qwen3-Omni pipeline config (seed 001, text prompts; stages and hooks: :mod:`.stages`).

Not registered as a served model yet (no ``EntryClass``): the chat endpoint it needs is
not part of the server. Build it with :meth:`Qwen3OmniPipelineConfig.for_model_path` and run
it with :class:`~omnistage.pipeline.pipeline.Pipeline`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

import numpy as np
import torch

from omnistage.config.pipeline import FactoryConfig, PipelineConfig, StageConfig
from omnistage.models.qwen3_omni.modeling.config import load_config
from omnistage.models.qwen3_omni.modeling.model import LoadFormat
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart

_STAGES = "omnistage.models.qwen3_omni.stages"
_TYPES = "omnistage.models.qwen3_omni.payload_types"
# what the edges carry (omnistage.pipeline.edges)
THINKER_PROMPT = f"{_TYPES}:ThinkerPrompt"
AUDIO_SETUP = f"{_TYPES}:AudioSetup"
TEXT_DELTA = f"{_TYPES}:TextDelta"
CHAT_TEXT = f"{_TYPES}:ChatText"
GENERATION_SUMMARY = "omnistage.scheduling.ar:GenerationSummary"
CODE_FRAMES = "omnistage.scheduling.ar:CodeFrames"
FRAME_WITH_HIDDEN = "omnistage.scheduling.ar:FrameWithHidden"
VOCODER_SETUP = "omnistage.scheduling.vocoder:VocoderSetup"
AUDIO_CHUNK = "omnistage.core.payloads:AudioChunk"
AUDIO_RESULT = "omnistage.core.payloads:AudioResult"


class Qwen3OmniPipelineConfig(PipelineConfig):
    @classmethod
    def for_model_path(
        cls, model_path: str, load_format: LoadFormat = "safetensors", talker_start_tokens: int = 2
    ) -> Self:
        """The pipeline for the checkpoint at ``model_path`` (CUDA when available, else CPU).

        Args:
            load_format: ``"dummy"``: random weights from the config alone (every stage).
            talker_start_tokens: reply tokens before the talker starts (>= 2).

        Raises:
            CheckpointConfigError: config.json missing or invalid.
            ValueError: the checkpoint has no talker (``enable_audio_output`` false).
        """
        if load_config(model_path).talker is None:
            raise ValueError(f"{model_path}: the checkpoint has no talker; this pipeline speaks")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        fmt = {"load_format": load_format}

        def stage(name: str, args: dict | None = None, **fields) -> StageConfig:
            factory = FactoryConfig(path=f"{_STAGES}:create_{name}_stage", args=args or {})
            return StageConfig(name=name, device=device, factory=factory, **fields)

        return cls(
            name=f"qwen3_omni:{Path(model_path).name}",
            model_path=model_path,
            entry_stage="preprocessing",
            terminal_stages_fn=f"{_STAGES}:terminal_stages",
            sample_requests_fn="omnistage.models.qwen3_omni.config:sample_requests",
            stages=[
                stage("code2wav", fmt, terminal=True, can_accept_stream_before_payload=True,
                      payload_type=GENERATION_SUMMARY, accepts_stream_types=[VOCODER_SETUP, CODE_FRAMES],
                      result_type=AUDIO_RESULT, stream_types=[AUDIO_CHUNK]),
                stage("preprocessing", next=["audio_encoder", "thinker"], route_fn=f"{_STAGES}:preprocessing_routes",
                      stream_to=["talker", "code2wav"], stream_done_to_fn=f"{_STAGES}:preprocessing_streams",
                      result_type=THINKER_PROMPT, stream_types=[AUDIO_SETUP]),
                stage("audio_encoder", fmt, next="thinker", payload_type=THINKER_PROMPT, result_type=THINKER_PROMPT),
                stage("thinker", fmt, wait_for=["preprocessing", "audio_encoder"], wait_for_fn=f"{_STAGES}:thinker_waits_for",
                      merge_fn=f"{_STAGES}:thinker_merge", next=["decode", "talker"], route_fn=f"{_STAGES}:thinker_routes",
                      stream_to=["decode", "talker"], stream_done_to_fn=f"{_STAGES}:thinker_streams",
                      payload_type=THINKER_PROMPT, result_type=GENERATION_SUMMARY, stream_types=[CODE_FRAMES, FRAME_WITH_HIDDEN]),
                stage("decode", terminal=True, can_accept_stream_before_payload=True, payload_type=GENERATION_SUMMARY,
                      accepts_stream_types=[CODE_FRAMES, FRAME_WITH_HIDDEN], result_type=CHAT_TEXT, stream_types=[TEXT_DELTA]),
                # CodeFrames: declared because the thinker streams them to text-only requests'
                # targets; an audio request's thinker sends FrameWithHidden
                stage("talker", {**fmt, "talker_start_tokens": talker_start_tokens}, next="code2wav", stream_to=["code2wav"],
                      can_accept_stream_before_payload=True, payload_type=GENERATION_SUMMARY,
                      accepts_stream_types=[AUDIO_SETUP, CODE_FRAMES, FRAME_WITH_HIDDEN], result_type=GENERATION_SUMMARY,
                      stream_types=[CODE_FRAMES]),
            ],
        )  # fmt: skip


def sample_requests() -> list[tuple[str, Qwen3OmniRequest]]:
    """Text in, text out; text in, text + audio out; audio in, text + audio out (the
    consistency check's cases)."""
    messages = (ChatMessage("user", (ChatPart("text", text="Hello."),)),)
    clip = ChatPart("audio", audio=np.zeros(16000, dtype=np.float32))
    heard = (ChatMessage("user", (clip, ChatPart("text", text="What is this?"))),)
    text = Qwen3OmniRequest(
        messages, False, "ethan", OmniSampling(), max_tokens=4, max_audio_frames=4
    )
    return [
        ("text", text),
        ("text+audio", Qwen3OmniRequest(messages, True, "ethan", OmniSampling(), 4, 4)),
        ("audio in", Qwen3OmniRequest(heard, True, "ethan", OmniSampling(), 4, 4)),
    ]
