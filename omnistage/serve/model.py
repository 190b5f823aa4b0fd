"""The contract between the framework and a model package.

A model package ``omnistage/models/<name>/config.py`` exposes ``EntryClass`` (a
:class:`SpeechModelConfig` subclass: the pipeline's defaults plus what the server needs)
and optionally ``Variants`` (``{name: SpeechModelConfig subclass}``). The framework never
imports a model by name: :mod:`omnistage.serve.registry` discovers them.

Output convention for speech: audio terminal stages stream
:class:`omnistage.core.payloads.AudioChunk` items (mono float32 PCM at
``capabilities().sample_rate``) and finish with an
:class:`omnistage.core.payloads.AudioResult`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Self

from omnistage.config.pipeline import PipelineConfig
from omnistage.serve.media import MediaPolicy
from omnistage.serve.protocol import SpeechCapabilities, SpeechRequest


class SpeechModelConfig(PipelineConfig):
    """Base of a speech model's ``EntryClass``.

    Class attributes:
        architecture: matched against the checkpoint's ``config.json`` ``architectures``.
        aliases: other architecture names for the same model.
        embedded_models: names served without a checkpoint path (e.g. a bundled voice);
            the first one of the registry's default model is what ``omnistage serve``
            without ``--model-path`` serves.
    """

    architecture: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    embedded_models: ClassVar[tuple[str, ...]] = ()
    is_default: ClassVar[bool] = False

    @classmethod
    def claims(cls, path: Path) -> bool:
        """True if ``path`` is a checkpoint of this model in a layout without a
        ``config.json`` (e.g. a Piper ``.onnx`` voice)."""
        return False

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        """The default pipeline for the checkpoint (or embedded name) ``model_path``.

        Raises:
            FileNotFoundError / ValueError: the checkpoint is missing or malformed.
        """
        raise NotImplementedError

    def capabilities(self) -> SpeechCapabilities:
        """What this model accepts (fields, voices, languages, limits)."""
        raise NotImplementedError

    def build_request(self, request: SpeechRequest, media: MediaPolicy) -> Any:
        """Turn a validated speech request into the pipeline's typed request; any
        remaining bad input raises :class:`~omnistage.core.errors.RequestValidationError`
        here, before model work."""
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

    def warmup_request(self) -> SpeechRequest:
        """A small request the server runs once before reporting ready."""
        return SpeechRequest(input="Hello.")
