"""The Qwen3-Omni pipeline (seed 001's seven stages; stages and hooks: :mod:`.stages`):
``EntryClass``, a chat model.

``omnistage serve --model-path DIR`` with a checkpoint in the real Hugging Face layout
(``config.json`` ``architectures: ["Qwen3OmniMoeForConditionalGeneration"]``) serves it at
``POST /v1/chat/completions`` (text and audio in; text, and speech in the talker's voices,
out) on CUDA when available, else on CPU. ``--load-format dummy`` builds random weights on
the device from ``config.json`` alone (the real size does not fit the GPU machine's disk).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import ClassVar, Literal, Self, get_args

import numpy as np
import torch
from PIL import Image

from omnistage.config.pipeline import FactoryConfig, StageConfig
from omnistage.models.qwen3_omni.modeling.config import Qwen3OmniConfig, load_config
from omnistage.models.qwen3_omni.modeling.model import LoadFormat
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart, Qwen3OmniProcessor
from omnistage.models.qwen3_omni.random_checkpoint import RANDOM_CHECKPOINT
from omnistage.models.qwen3_omni.request_builders import (
    ChatLimits,
    Qwen3OmniChatRequest,
    build_chat_request,
)
from omnistage.models.qwen3_omni.stages import MAX_MODEL_LEN, SAMPLE_RATE
from omnistage.serve.chat_media import ChatTurn
from omnistage.serve.chat_protocol import ChatCapabilities
from omnistage.serve.model import ChatModelConfig

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
STOP_TAIL = "omnistage.scheduling.ar:StopTail"
VOCODER_SETUP = "omnistage.scheduling.vocoder:VocoderSetup"
AUDIO_CHUNK = "omnistage.core.payloads:AudioChunk"
AUDIO_RESULT = "omnistage.core.payloads:AudioResult"


Placement = Literal["colocated", "split"]
SPEECH_SIDE = ("talker", "code2wav")
"""The stages the split placement puts on the second GPU (the others: the first), in a
process of their own: process group :data:`SPEECH_PROCESS` (the others run in the server's
process), so the two engines' host work does not share one interpreter."""
SPEECH_PROCESS = "speech"


def stage_devices(placement: Placement) -> tuple[str, str]:
    """``(thinker side, speech side)`` devices of a placement: colocated, both on CUDA when
    available, else the CPU; split, ``cuda:0`` and ``cuda:1``.

    Raises: ValueError: split without two CUDA devices (it is never silently colocated)."""
    if placement == "colocated":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return device, device
    if placement != "split":
        raise ValueError(f"placement must be 'colocated' or 'split', got {placement!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        raise ValueError(f"the split placement needs two CUDA devices; {count} visible")
    return "cuda:0", "cuda:1"


#: The thinker's reply cap: the highest ``max_tokens`` and the default (transformers'
#: ``thinker_max_new_tokens`` default); prompt + reply must fit the thinker stage's
#: ``max_model_len`` (8192).
MAX_TOKENS_LIMIT, DEFAULT_MAX_TOKENS = 4096, 1024


class Qwen3OmniPipelineConfig(ChatModelConfig):
    architecture = "Qwen3OmniMoeForConditionalGeneration"
    chat_request = Qwen3OmniChatRequest
    random_checkpoint = RANDOM_CHECKPOINT
    load_formats: ClassVar[tuple[str, ...]] = tuple(f for f in get_args(LoadFormat) if f != "safetensors")

    @classmethod
    def for_model_path(
        cls,
        model_path: str,
        load_format: LoadFormat = "safetensors",
        talker_start_tokens: int = 2,
        placement: Placement = "colocated",
        speech: bool = True,
    ) -> Self:
        """The pipeline for the checkpoint at ``model_path``.

        Args:
            load_format: ``"dummy"``: random weights from the config alone (every stage).
            talker_start_tokens: reply tokens before the talker starts (>= 2).
            placement: ``"colocated"``: every stage on one device (CUDA when available,
                else the CPU), in the server's process; ``"split"``: the thinker and its
                stages on ``cuda:0`` in the server's process, the talker and code2wav
                (:data:`SPEECH_SIDE`) on ``cuda:1`` in process group :data:`SPEECH_PROCESS`;
                the talker stage then loads the thinker's token embedding beside the talker
                (:func:`~.stages.language_parts`). ``--<stage>.device`` overrides either.
            speech: False: the text-only pipeline (the ``text`` variant): no talker or
                code2wav stage, so talker, code predictor and code2wav are never built or
                loaded; it serves a checkpoint without a talker too.

        Raises:
            CheckpointConfigError: config.json missing or invalid.
            ValueError: ``speech`` and the checkpoint has no talker (``enable_audio_output``
                false), the split placement without ``speech``, or :func:`stage_devices`
                refuses the placement.
        """
        if speech and load_config(model_path).talker is None:
            raise ValueError(f"{model_path}: the checkpoint has no talker; serve it with the text variant")
        if not speech and placement != "colocated":
            raise ValueError("the text-only pipeline has no speech side to place apart; its placement is colocated")
        thinker_side, speech_side = stage_devices(placement)
        fmt = {"load_format": load_format}

        def stage(name: str, args: dict | None = None, **fields) -> StageConfig:
            factory = FactoryConfig(path=f"{_STAGES}:create_{name}_stage", args=args or {})
            apart = name in SPEECH_SIDE and placement == "split"
            device = speech_side if name in SPEECH_SIDE else thinker_side
            return StageConfig(name=name, device=device, process=SPEECH_PROCESS if apart else None, factory=factory, **fields)

        speech_stages = [
            stage("code2wav", fmt, terminal=True, can_accept_stream_before_payload=True,
                  payload_type=GENERATION_SUMMARY, accepts_stream_types=[VOCODER_SETUP, CODE_FRAMES],
                  result_type=AUDIO_RESULT, stream_types=[AUDIO_CHUNK]),
            # CodeFrames: declared because the thinker streams them to text-only requests'
            # targets; an audio request's thinker sends FrameWithHidden
            stage("talker", {**fmt, "talker_start_tokens": talker_start_tokens}, next="code2wav", stream_to=["code2wav"],
                  can_accept_stream_before_payload=True, payload_type=GENERATION_SUMMARY,
                  accepts_stream_types=[AUDIO_SETUP, CODE_FRAMES, FRAME_WITH_HIDDEN, STOP_TAIL], result_type=GENERATION_SUMMARY,
                  stream_types=[CODE_FRAMES]),
        ] if speech else []  # fmt: skip
        speakers = list(SPEECH_SIDE) if speech else []
        variant = "" if speech else ":text"
        return cls(
            name=f"qwen3_omni:{Path(model_path).name}" + ("" if placement == "colocated" else f":{placement}") + variant,
            model_path=model_path,
            entry_stage="preprocessing",
            terminal_stages_fn=f"{_STAGES}:terminal_stages",
            sample_requests_fn=f"omnistage.models.qwen3_omni.config:{'' if speech else 'text_'}sample_requests",
            stages=[
                *speech_stages[:1],
                stage("preprocessing", next=["image_encoder", "audio_encoder", "thinker"], route_fn=f"{_STAGES}:preprocessing_routes",
                      stream_to=speakers, stream_done_to_fn=f"{_STAGES}:preprocessing_streams" if speech else None,
                      result_type=THINKER_PROMPT, stream_types=[AUDIO_SETUP] if speech else []),
                stage("image_encoder", fmt, next="thinker", payload_type=THINKER_PROMPT, result_type=THINKER_PROMPT),
                stage("audio_encoder", fmt, next="thinker", payload_type=THINKER_PROMPT, result_type=THINKER_PROMPT),
                stage("thinker", fmt, wait_for=["preprocessing", "image_encoder", "audio_encoder"], wait_for_fn=f"{_STAGES}:thinker_waits_for",
                      merge_fn=f"{_STAGES}:thinker_merge", next=["decode", *speakers[:1]], route_fn=f"{_STAGES}:thinker_routes",
                      stream_to=["decode", *speakers[:1]], stream_done_to_fn=f"{_STAGES}:thinker_streams",
                      payload_type=THINKER_PROMPT, result_type=GENERATION_SUMMARY, stream_types=[CODE_FRAMES, FRAME_WITH_HIDDEN, STOP_TAIL]),
                stage("decode", terminal=True, can_accept_stream_before_payload=True, payload_type=GENERATION_SUMMARY,
                      accepts_stream_types=[CODE_FRAMES, FRAME_WITH_HIDDEN, STOP_TAIL], result_type=CHAT_TEXT, stream_types=[TEXT_DELTA]),
                *speech_stages[1:],
            ],
        )  # fmt: skip

    @property
    def speaks(self) -> bool:
        """The pipeline has the speech side (talker and code2wav); the text variant has not."""
        return any(stage.name == "talker" for stage in self.stages)


    def capabilities(self) -> ChatCapabilities:
        """Text, images, audio and video in; speech in the talker config's speakers (its voices),
        unless the pipeline has no talker (:attr:`speaks`); the thinker's ``max_tokens`` limits."""
        assert self.model_path is not None
        return ChatCapabilities(
            model_names=(Path(self.model_path).name, "qwen3-omni"), model_type="qwen3_omni",
            input_modalities=frozenset({"text", "image", "audio", "video"}), audio_output=self.speaks,
            voices=_voices(self.model_path) if self.speaks else (),
            sample_rate=SAMPLE_RATE, supported_fields=frozenset({"top_k", "seed", "stop", "max_audio_seconds", "use_audio_in_video"}),
            max_tokens_limit=MAX_TOKENS_LIMIT, default_max_tokens=DEFAULT_MAX_TOKENS,
        )  # fmt: skip

    def build_request(self, request: Qwen3OmniChatRequest, turns: tuple[ChatTurn, ...]) -> Qwen3OmniRequest:
        """Raises: RequestValidationError: also a prompt + reply (or speech) over the thinker
        (talker) stage's ``max_model_len``, counted from token ids and the media's sizes."""
        assert self.model_path is not None
        return build_chat_request(
            request, turns, _processor(self.model_path), _config(self.model_path), self._limits()
        )

    def _limits(self) -> ChatLimits:
        """The thinker and talker stages' ``max_model_len`` (the factory's default unless
        the config sets it)."""

        def max_model_len(stage: str) -> int:
            return int(self.stage(stage).factory.args.get("max_model_len", MAX_MODEL_LEN))

        talker = max_model_len("talker") if self.speaks else 0  # no request speaks
        return ChatLimits(DEFAULT_MAX_TOKENS, max_model_len("thinker"), talker)

    def sample_requests(self) -> list[Qwen3OmniChatRequest]:
        """A 4-token reply spoken in 4 frames at most (the warm-up runs every stage but the
        audio encoder); the text variant's, not spoken."""
        assert self.model_path is not None
        if not self.speaks:
            return [Qwen3OmniChatRequest(messages=[{"role": "user", "content": "Hello."}], max_tokens=4)]
        voice = _voices(self.model_path)[0]
        return [Qwen3OmniChatRequest(
            messages=[{"role": "user", "content": "Hello."}], modalities=["text", "audio"],
            audio={"voice": voice, "format": "wav"}, max_tokens=4, max_audio_seconds=4 / 12.5,
        )]  # fmt: skip


@lru_cache(maxsize=8)
def _config(model_path: str) -> Qwen3OmniConfig:
    """The checkpoint's config. Raises: CheckpointConfigError naming the field."""
    return load_config(model_path)


@lru_cache(maxsize=8)
def _processor(model_path: str) -> Qwen3OmniProcessor:
    """The preprocessing stage's processor (tokenizer, template, feature sizes), for the
    request boundary's count."""
    return Qwen3OmniProcessor.from_checkpoint(model_path, _config(model_path).thinker.audio)


@lru_cache(maxsize=8)
def _voices(model_path: str) -> tuple[str, ...]:
    """The voices: the talker config's speaker names (lower case), in its order. Raises:
    CheckpointConfigError naming the field."""
    talker = _config(model_path).talker
    assert talker is not None  # for_model_path refuses a checkpoint without one
    return tuple(talker.speaker_id)


class Qwen3OmniSplitPipelineConfig(Qwen3OmniPipelineConfig):
    """The ``split`` variant (``--variant split``): the thinker side on ``cuda:0``, the talker
    and code2wav on ``cuda:1`` in a process of their own (:func:`stage_devices`; refused
    without two GPUs)."""

    @classmethod
    def for_model_path(
        cls, model_path: str, load_format: LoadFormat = "safetensors", talker_start_tokens: int = 2,
        placement: Placement = "split",
    ) -> Self:
        return super().for_model_path(model_path, load_format, talker_start_tokens, placement)


class Qwen3OmniTextPipelineConfig(Qwen3OmniPipelineConfig):
    """The ``text`` variant (``--variant text``): the thinker side alone, text out
    (``for_model_path(speech=False)``); a request for audio is a 400 on ``modalities``."""

    @classmethod
    def for_model_path(
        cls, model_path: str, load_format: LoadFormat = "safetensors", talker_start_tokens: int = 2,
        placement: Placement = "colocated", speech: bool = False,
    ) -> Self:
        return super().for_model_path(model_path, load_format, talker_start_tokens, placement, speech)


EntryClass = Qwen3OmniPipelineConfig
Variants = {"split": Qwen3OmniSplitPipelineConfig, "text": Qwen3OmniTextPipelineConfig}


def sample_requests() -> list[tuple[str, Qwen3OmniRequest]]:
    """Text in, text out; text in, text + audio out; audio in, text + audio out; image and
    audio in, text out (the consistency check's cases: no encoder, each, both)."""
    messages = (ChatMessage("user", (ChatPart("text", text="Hello."),)),)
    clip = ChatPart("audio", audio=np.zeros(16000, dtype=np.float32))
    heard = (ChatMessage("user", (clip, ChatPart("text", text="What is this?"))),)
    picture = ChatPart("image", image=Image.new("RGB", (32, 32)))
    both = (ChatMessage("user", (picture, clip, ChatPart("text", text="And these?"))),)
    text = Qwen3OmniRequest(
        messages, False, "ethan", OmniSampling(), max_tokens=4, max_audio_frames=4
    )
    return [
        ("text", text),
        ("text+audio", Qwen3OmniRequest(messages, True, "ethan", OmniSampling(), 4, 4)),
        ("audio in", Qwen3OmniRequest(heard, True, "ethan", OmniSampling(), 4, 4)),
        ("image and audio in", Qwen3OmniRequest(both, False, "ethan", OmniSampling(), 4, 4)),
    ]


def text_sample_requests() -> list[tuple[str, Qwen3OmniRequest]]:
    """The text variant's: :func:`sample_requests` not spoken."""
    return [(label, request) for label, request in sample_requests() if not request.audio_output]
