"""Typed pipeline state of the Qwen3-Omni pipeline: the request and the payload of each edge.

Edges (seed 001):

- ``preprocessing -> image_encoder`` (prompts with images or video), ``preprocessing ->
  audio_encoder`` (prompts with audio, a video's included) or ``preprocessing -> thinker``
  (text prompts): a :class:`ThinkerPrompt`; ``image_encoder -> thinker``: the same with its
  ``vision_rows``, ``audio_encoder -> thinker`` with its ``audio_rows``;
- ``preprocessing ~> talker, code2wav`` (stream, audio requests only): one
  :class:`AudioSetup` (a stage's item goes to all its stream targets, so the one object
  is both the talker's setup and code2wav's
  :class:`~omnistage.scheduling.vocoder.VocoderSetup`);
- ``thinker ~> decode, talker`` (stream): each reply token; for an audio request as
  :class:`~omnistage.scheduling.ar.FrameWithHidden` items (with the layer-0 and
  ``accept_hidden_layer`` rows of the tokens fed), else as
  :class:`~omnistage.scheduling.ar.CodeFrames`; a reply cut by a stop string inside a
  token ends with a :class:`~omnistage.scheduling.ar.StopTail`;
- ``thinker -> decode``, ``thinker -> talker`` and ``talker -> code2wav``: a
  :class:`~omnistage.scheduling.ar.GenerationSummary` (the frames were streamed);
- ``talker ~> code2wav`` (stream): :class:`~omnistage.scheduling.ar.CodeFrames`;
- ``decode`` (terminal): :class:`~omnistage.core.payloads.TextDelta` items, then
  :class:`ChatText` (the framework's chat text convention); ``code2wav``
  (terminal): :class:`~omnistage.core.payloads.AudioChunk` items, then an
  :class:`~omnistage.core.payloads.AudioResult`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.core.errors import RequestValidationError
from omnistage.core.payloads import TextDelta, TextResult
from omnistage.core.request import PipelineRequest
from omnistage.models.qwen3_omni.modeling.mrope import MultimodalLayout
from omnistage.models.qwen3_omni.modeling.thinker import EncoderRows
from omnistage.models.qwen3_omni.processing import ChatMessage
from omnistage.scheduling.vocoder import VocoderSetup

__all__ = ["AudioSetup", "ChatText", "OmniSampling", "Qwen3OmniRequest", "TextDelta", "ThinkerPrompt"]


@dataclass(frozen=True)
class OmniSampling:
    """The client's sampling values (thinker and talker code 0 alike).

    Attributes:
        temperature: >= 0 (0 = greedy, the default).
        top_p: in (0, 1] (default 1).
        top_k: >= 0 (0 = off, the default).
        seed: 0..2**31-1, the sampler's seed.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass(frozen=True)
class TalkerSampling:
    """How the talker draws a frame: code 0 by the talker, codes 1..15 by the code predictor;
    both seeded by the request's ``sampling.seed`` (the engine gives the predictor a noise
    stream of its own).

    Defaults are the reference's (transformers 5.24 ``Qwen3OmniMoeForConditionalGeneration
    .generate``): code 0 sampled with ``talker_temperature`` 0.9, ``talker_top_k`` 50,
    ``talker_top_p`` 1.0, ``talker_repetition_penalty`` 1.05; the code predictor samples only
    when its generation config says ``do_sample`` (a default-built or ``from_pretrained`` model
    says False: greedy), and then with top_k 50, top_p 0.8 and its temperature (1.0 by
    default): ``predictor_temperature`` 0 here by default, the other two as the reference.

    Attributes:
        temperature, top_k, top_p, repetition_penalty: code 0 (temperature 0: greedy; the
            repetition penalty applies greedy too, as the reference's).
        predictor_temperature, predictor_top_k, predictor_top_p: codes 1..15 (temperature 0:
            greedy).

    Raises:
        RequestValidationError: a value out of range, naming ``talker_sampling.<field>``.
    """

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    predictor_temperature: float = 0.0
    predictor_top_k: int = 50
    predictor_top_p: float = 0.8

    def __post_init__(self) -> None:
        checks = {
            "temperature": self.temperature >= 0, "top_k": self.top_k >= 0, "top_p": 0 < self.top_p <= 1,
            "repetition_penalty": self.repetition_penalty > 0, "predictor_temperature": self.predictor_temperature >= 0,
            "predictor_top_k": self.predictor_top_k >= 0, "predictor_top_p": 0 < self.predictor_top_p <= 1,
        }  # fmt: skip
        for name, ok in checks.items():
            if not ok:
                field = f"talker_sampling.{name}"
                raise RequestValidationError(f"{field} = {getattr(self, name)!r} is out of range", param=field)

    @classmethod
    def greedy(cls) -> TalkerSampling:
        """The reference's greedy talker (``talker_do_sample=False``: argmax code 0 with its
        repetition penalty 1.05; top-k off, it changes no argmax) and greedy code predictor:
        the parity tests' setting."""
        return cls(temperature=0.0, top_k=0, predictor_temperature=0.0)


@dataclass(frozen=True)
class Qwen3OmniRequest(PipelineRequest):
    """A validated chat request (built by :func:`.request_builders.build_chat_request`).

    Attributes:
        messages: the conversation (system / user / assistant turns of text and audio).
        audio_output: speech is requested (``modalities`` holds ``"audio"``): the one
            predicate every routing hook of the pipeline decides from.
        voice: a ``talker_config.speaker_id`` name (lower case), used when ``audio_output``.
        sampling: the client's sampling values (the thinker's; its seed seeds the talker too).
        max_tokens: reply tokens at most (the thinker's cap), >= 1.
        max_audio_frames: talker frames at most (80 ms each), >= 1.
        stream: the response is streamed.
        talker_sampling: how the talker and its code predictor draw (the reference's by
            default).
        prompt_audio_tokens, prompt_image_tokens: the thinker prompt's positions holding
            audio and images or video (:meth:`.processing.Qwen3OmniProcessor.media_positions`,
            counted at the request boundary), reported in the decode stage's result.
        stop: stop strings (OpenAI's ``stop``, each non-empty): the reply ends before the
            first of them (the thinker stage's stop strings, :mod:`omnistage.scheduling.stop_strings`);
            the talker voices only that reply.
    """

    messages: tuple[ChatMessage, ...]
    audio_output: bool
    voice: str
    sampling: OmniSampling
    max_tokens: int
    max_audio_frames: int
    stream: bool = False
    talker_sampling: TalkerSampling = TalkerSampling()
    prompt_audio_tokens: int = 0
    prompt_image_tokens: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ThinkerPrompt:
    """The thinker's prompt before the engine.

    Attributes:
        input_ids: ``[L] int64``, media placeholders expanded.
        positions: ``[3, L] float32`` MRoPE positions (a video's T may be fractional);
            ``rope_delta``: their decode offset.
        layout: the prompt's multimodal layout (the talker's positions need it too).
        audio_features: ``[128, sum(frames)]`` float32 log-mel frames of the prompt's audios
            (a video's audio included when asked), or None; ``audio_frames``: ``[A] int64``
            frames per audio.
        audio_rows: the audio encoder's ``[Na, H]`` rows (set by ``audio_encoder``), or None.
        pixel_values: ``[sum(t*h*w), 1536]`` float32 image patches, or None;
            ``image_grid_thw``: ``[I, 3] int64``.
        pixel_values_videos: video patches, or None; ``video_grid_thw``: ``[V, 3] int64``.
        vision_rows: the vision encoder's image / video rows and their deepstack levels (set
            by ``image_encoder``; its ``audio`` is None), or None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    rope_delta: float
    layout: MultimodalLayout
    audio_features: torch.Tensor | None = None
    audio_frames: torch.Tensor | None = None
    audio_rows: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    vision_rows: EncoderRows | None = None


@dataclass(frozen=True, kw_only=True)
class AudioSetup(VocoderSetup):
    """What the talker and code2wav need from preprocessing, besides their streams (a
    :class:`VocoderSetup` for code2wav: the chunk ramp, no left context).

    Attributes:
        prompt_ids: the thinker prompt ``[L] int64`` (user turns and the assistant opening
            decide the talker prompt's layout).
        layout: the thinker prompt's multimodal layout (the talker's positions).
        voice: the talker's voice (a ``speaker_id`` name of the talker config, lower case).
        sampling: the talker's and code predictor's sampling.
        seed: the request's seed.
        max_frames: talker frames at most.
    """

    prompt_ids: torch.Tensor
    layout: MultimodalLayout
    voice: str
    sampling: TalkerSampling
    seed: int
    max_frames: int


@dataclass(frozen=True, kw_only=True)
class ChatText(TextResult):
    """The ``decode`` stage's result, the framework's :class:`TextResult` (its
    finish_reason, the thinker's, travels in the framework's result: ``"stop"`` at
    ``<|im_end|>``, ``"length"`` at ``max_tokens``) with the reply's tokens.

    Attributes:
        token_ids: the reply tokens ``[G] int64`` (the stop token excluded).
    """

    token_ids: torch.Tensor
