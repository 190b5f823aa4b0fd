"""Typed pipeline state of the Qwen3-TTS pipeline (request side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from omnistage.core.request import PipelineRequest
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_tts.capabilities import ModelType

if TYPE_CHECKING:  # the prompt module needs transformers: not loaded to serve a schema
    from omnistage.models.qwen3_tts.modeling.prompt import PromptHead, TargetIds


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling values the client set; None = take generation_config.json's value.

    Attributes:
        temperature: >= 0 (0 = greedy).
        top_k: >= 0 (0 = off).
        top_p: in (0, 1].
        repetition_penalty: > 0 (talker only).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields have no boolean equality
class Qwen3TTSRequest(PipelineRequest):
    """A validated synthesis request (built by :func:`.request_builders.build_qwen3_tts_request`).

    Attributes:
        text: the text to speak (non-blank, at most ``MAX_INPUT_CHARS`` characters).
        target_ids: ``text``'s token ids in the talker prompt's template
            (:meth:`~.modeling.prompt.PromptTokens.target`), made once by the request
            builder, which sizes the prompt with them; the preprocessing stage builds the
            prompt from them. With ``more_text``, the ids of the first part only (a live
            prompt tokenizes its text as it grows).
        model_type: the served checkpoint's type (``base`` | ``custom_voice`` |
            ``voice_design``); decides the prompt layout.
        language: ``"auto"`` or a non-dialect ``codec_language_id`` key, as requested
            (the prompt builder switches dialect speakers to their dialect).
        voice: CustomVoice speaker name (a ``spk_id`` key); None otherwise.
        instructions: the instructions text (VoiceDesign: always; CustomVoice 1.7B: optional).
        ref_audio: Base only: the reference voice, mono float32 ``[S]`` at 24 kHz,
            0.5..30 s; None for the other types.
        ref_key: ``ref_audio``'s content key (64 hex digits,
            :attr:`omnistage.serve.media.ReferenceClip.key`: equal keys, equal samples):
            the reference encoder's cache key; set exactly when ``ref_audio`` is.
        ref_text: transcript of ``ref_audio`` (ICL clone); None in x-vector-only mode.
        x_vector_only: Base only: clone from the speaker embedding alone (no reference
            codes or text in the prompt).
        non_streaming_mode: True = the whole text is in the prompt; False = the text is
            fed one token per generated frame (streaming-text mode).
        sampling: the client's sampling values (see :func:`resolve_sampling`).
        seed: seed of this request's sampling, 0..2**31-1 (drawn at random when the client
            gave none, so it is always known and any output can be reproduced).
        max_new_tokens: the client's frame cap, 1..8192; None = the text-proportional cap.
        min_new_tokens: frames before EOS may stop the request (>= 2).
        frame_cap: the text-proportional frame cap, :func:`max_frames_for_text`.
        initial_codec_chunk_frames: frames of the first vocoder chunk (>= 0); None = the
            vocoder's default ramp.
        stream: the response is streamed.
        more_text: the text continues after the request started (a live WebSocket
            session): ``text`` is what came first, the rest arrives as
            :class:`~omnistage.core.payloads.InputText` and ends with the client's end of
            input; ``frame_cap`` then follows the whole text once it is known.
    """

    text: str
    target_ids: TargetIds
    model_type: ModelType
    language: str
    voice: str | None
    instructions: str | None
    ref_audio: np.ndarray | None
    ref_key: str | None
    ref_text: str | None
    x_vector_only: bool
    non_streaming_mode: bool
    sampling: SamplingOverrides
    seed: int
    max_new_tokens: int | None
    min_new_tokens: int
    frame_cap: int
    initial_codec_chunk_frames: int | None
    stream: bool
    more_text: bool = False

    def __post_init__(self) -> None:
        if (self.ref_audio is None) != (self.ref_key is None):
            raise ValueError("ref_audio and ref_key are set together")

    @property
    def icl(self) -> bool:
        """In-context clone: reference codes and ``ref_text`` go into the prompt."""
        return self.ref_audio is not None and not self.x_vector_only


@dataclass(frozen=True)
class Qwen3TTSSampling:
    """A request's resolved generation settings (:func:`.request_builders.resolve_sampling`).

    Attributes:
        talker: code 0 of each frame: EOS stops, control codes suppressed,
            ``min_new_tokens`` 2.
        code_predictor: codes 1..15 of each frame: no repetition penalty, no stop ids.
        max_new_tokens: frames to generate at most (finish_reason "length" when reached).
    """

    talker: SamplingParams
    code_predictor: SamplingParams
    max_new_tokens: int


@dataclass(frozen=True)
class EncodedReference:
    """A voice-clone clip, encoded (the ``reference_encoder`` stage's result).

    Attributes:
        x_vector: ``[H]`` the speaker encoder's embedding, in its dtype, on its device.
        ref_codes: ``[ceil(S / 1920), 16] int64`` the speech tokenizer's codes, on the host.
    """

    x_vector: torch.Tensor
    ref_codes: torch.Tensor


@dataclass(frozen=True)
class LivePrompt:
    """A request whose text is still arriving, as the ``tts_engine`` stage starts it
    (:class:`~.live_text.LiveTextFeed`).

    Attributes:
        head: the talker prompt before its text.
        text: the text the request came with (more follows).
        sampling: its sampling; ``max_new_tokens`` is the frames reserved (the client's
            cap, else the checkpoint's ``max_new_tokens``) until the whole text is known.
        min_new_tokens: frames before EOS may stop it.
        text_cap_limit: the highest text-proportional cap (the checkpoint's
            ``max_new_tokens``), applied to the whole text once it is known
            (:func:`~.request_builders.text_frame_cap`); None: the client set
            ``max_new_tokens``, which stays.
    """

    head: PromptHead
    text: str
    sampling: Qwen3TTSSampling
    min_new_tokens: int
    text_cap_limit: int | None


@dataclass(frozen=True)
class TalkerStart:
    """``preprocessing`` -> ``tts_engine``: exactly one of ``whole`` (the request's whole
    input: its text is complete) and ``live`` (its text is still arriving)."""

    whole: GenerationInput | None = None
    live: LivePrompt | None = None

    def __post_init__(self) -> None:
        if (self.whole is None) == (self.live is None):
            raise ValueError("a TalkerStart is either whole or live")
