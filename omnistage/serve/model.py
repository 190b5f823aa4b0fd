"""The contract between the framework and a model package.

A model package ``omnistage/models/<name>/config.py`` (or one named in
``OMNISTAGE_EXTRA_MODELS``) exposes ``EntryClass`` (a :class:`ModelConfig` subclass of one
of two kinds: :class:`SpeechModelConfig`, served at ``/v1/audio/speech``, or
:class:`ChatModelConfig`, served at ``/v1/chat/completions``) and optionally ``Variants``
(``{name: subclass}``). The
framework never imports a model by name: :mod:`omnistage.serve.registry` discovers them,
and the server, the CLI and the docs derive what they show from what ``EntryClass``
declares: its request schema per endpoint (``speech_request`` for ``/v1/audio/speech``,
``chat_request`` for ``/v1/chat/completions``),
its voices and capabilities, its pipeline (``for_model_path``), its sample requests, and
its random-checkpoint writer (``random_checkpoint``).

Output convention for speech: audio terminal stages stream
:class:`omnistage.core.payloads.AudioChunk` items (mono float32 PCM at
``capabilities().sample_rate``) and finish with an
:class:`omnistage.core.payloads.AudioResult`. For chat: the text terminal stage streams
:class:`omnistage.core.payloads.TextDelta` items and finishes with a
:class:`omnistage.core.payloads.TextResult`; a reply with audio adds an audio terminal
stage of the speech convention.

Load formats: a model that can build random weights on the device from its config alone
(``omnistage serve --load-format dummy``, the vLLM/SGLang convention) lists ``"dummy"`` in
``load_formats``; its ``for_model_path`` then takes ``load_format=`` (the registry passes it
only when the user asks). Any other model refuses the option with an error naming the
formats it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

from omnistage.config.pipeline import PipelineConfig
from omnistage.core.request import PipelineRequest
from omnistage.serve.chat_media import ChatTurn
from omnistage.serve.chat_protocol import ChatCapabilities, ChatCompletionRequest
from omnistage.serve.media import MediaPolicy
from omnistage.serve.protocol import SpeechCapabilities, SpeechRequest


@dataclass(frozen=True)
class RandomCheckpoint:
    """A model's random-weight checkpoint writer (``omnistage init-random``).

    Attributes:
        writer: dotted path ``"package.module:function"`` of ``function(out_dir: Path,
            size: str, model_type: str, seed: int, device: str) -> Path`` writing a
            checkpoint in the model's real layout and returning its directory; imported
            only when chosen.
        sizes: the ``--size`` values it offers (the first is the default).
        types: the ``--type`` values it offers (the first is the default; empty: the
            model has one type and ``--type`` is refused).
    """

    writer: str
    sizes: tuple[str, ...]
    types: tuple[str, ...] = ()


class ModelConfig(PipelineConfig):
    """Base of every model's ``EntryClass`` (what both kinds declare).

    Class attributes:
        architecture: matched against the checkpoint's ``config.json`` ``architectures``.
        aliases: other architecture names for the same model.
        embedded_models: names served without a checkpoint path (e.g. a bundled voice);
            the first one of the registry's default model is what ``omnistage serve``
            without ``--model-path`` serves.
        random_checkpoint: its random-checkpoint writer, or None.
        load_formats: the ``--load-format`` values it takes besides its default (module
            docstring); empty: the option is refused.
    """

    architecture: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    embedded_models: ClassVar[tuple[str, ...]] = ()
    is_default: ClassVar[bool] = False
    random_checkpoint: ClassVar[RandomCheckpoint | None] = None
    load_formats: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def claims(cls, path: Path) -> bool:
        """True if ``path`` is a checkpoint of this model in a layout without a
        ``config.json`` (e.g. a Piper ``.onnx`` voice)."""
        return False

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        """The default pipeline for the checkpoint (or embedded name) ``model_path``; a
        model with ``load_formats`` also takes ``load_format=`` (one of them).

        Raises:
            FileNotFoundError / ValueError: the checkpoint is missing or malformed.
        """
        raise NotImplementedError


class ChatModelConfig(ModelConfig):
    """Base of a chat model's ``EntryClass`` (``POST /v1/chat/completions``).

    Class attributes:
        chat_request: the model's schema: :class:`ChatCompletionRequest` or a subclass
            adding its own fields (an unknown field is a 400 listing them).
    """

    chat_request: ClassVar[type[ChatCompletionRequest]] = ChatCompletionRequest

    def capabilities(self) -> ChatCapabilities:
        """What this checkpoint accepts: input kinds, speakers, formats, limits."""
        raise NotImplementedError

    def build_request(self, request: ChatCompletionRequest, turns: tuple[ChatTurn, ...]) -> PipelineRequest:
        """Turn a validated request (an instance of ``chat_request``) and its messages
        with their media decoded into the pipeline's typed request; any remaining bad
        input raises :class:`~omnistage.core.errors.RequestValidationError` naming the
        field, before model work. Called on a worker thread (it may block)."""
        raise NotImplementedError

    def sample_requests(self) -> list[ChatCompletionRequest]:
        """Small valid requests (at least one): the server runs the first once before
        reporting ready."""
        return [self.chat_request(messages=[{"role": "user", "content": "Hello."}], max_tokens=4)]


class SpeechModelConfig(ModelConfig):
    """Base of a speech model's ``EntryClass``.

    Class attributes:
        speech_request: the model's ``/v1/audio/speech`` schema: :class:`SpeechRequest`
            or a subclass adding the model's own fields (pydantic types and ranges them;
            an unknown field is a 400 listing them; ``/v1/audio/voices`` shows them).
    """

    speech_request: ClassVar[type[SpeechRequest]] = SpeechRequest

    def capabilities(self) -> SpeechCapabilities:
        """What this checkpoint accepts (which optional fields of ``speech_request``,
        voices, languages, limits)."""
        raise NotImplementedError

    def build_request(self, request: SpeechRequest, media: MediaPolicy) -> PipelineRequest:
        """Turn a validated speech request (an instance of ``speech_request``) into the
        pipeline's typed request; any remaining bad input raises
        :class:`~omnistage.core.errors.RequestValidationError` here, before model work."""
        raise NotImplementedError

    def build_live_request(self, request: SpeechRequest, media: MediaPolicy) -> PipelineRequest:
        """As :meth:`build_request`, for a request whose text continues while it runs
        (``request.input`` is the text so far): the rest comes as
        :class:`~omnistage.core.payloads.InputText` client input, then its end
        (:meth:`omnistage.pipeline.pipeline.Pipeline.send_input` / ``end_input``). Called
        only for a model whose capabilities declare ``live_text_input``; its pipeline has
        the stage that takes the input (``accepts_client_input``)."""
        raise NotImplementedError

    def with_saved_voice(self, request: SpeechRequest, audio: str, ref_text: str | None) -> SpeechRequest:
        """``request`` cloning a saved voice: ``audio`` is its clip as a data URI,
        ``ref_text`` its transcript (None: none was saved). Called only for a model whose
        capabilities declare ``saved_voices``; the result is validated and built as any
        request.

        Raises:
            RequestValidationError: the request also carries its own reference.
        """
        raise NotImplementedError

    def sample_requests(self) -> list[SpeechRequest]:
        """Small valid requests for this checkpoint (at least one): the server runs the
        first once before reporting ready."""
        return [self.speech_request(input="Hello.")]
