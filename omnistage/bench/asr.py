"""Speech recognizers that the WER benchmark transcribes synthesized audio with.

A backend is anything with ``name`` and ``transcribe(audio, sample_rate) -> str``
(:class:`ASRBackend`). Two are provided:

* :class:`PocketSphinxASR` (default): offline CMU PocketSphinx with the US English model
  shipped in the ``pocketsphinx`` wheel; fast on CPU, much less accurate than Whisper, so
  its WER is an intelligibility floor, comparable across runs rather than across papers.
* :class:`WhisperASR`: a Whisper checkpoint from a local directory through the
  ``transformers`` ASR pipeline (seed-tts-eval scores English with Whisper-large-v3).

Both resample input to 16 kHz (their models' rate) with soxr.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import soxr

__all__ = ["ASR_SAMPLE_RATE", "ASRBackend", "PocketSphinxASR", "WhisperASR"]

ASR_SAMPLE_RATE = 16000  # PocketSphinx en-us and Whisper front ends both expect 16 kHz


@runtime_checkable
class ASRBackend(Protocol):
    """A speech recognizer."""

    name: str

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        """Text of ``audio`` (float32 mono, 1-D, in [-1, 1]) sampled at ``sample_rate`` Hz."""
        ...


def to_asr_input(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """float32 mono at :data:`ASR_SAMPLE_RATE`, resampled with soxr when needed.

    Raises:
        ValueError: ``audio`` is not 1-D or ``sample_rate`` is not positive.
    """
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"audio must be 1-D mono, got shape {audio.shape}")
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be > 0, got {sample_rate}")
    if sample_rate == ASR_SAMPLE_RATE or audio.size == 0:
        return audio
    return soxr.resample(audio, sample_rate, ASR_SAMPLE_RATE).astype(np.float32, copy=False)


class PocketSphinxASR:
    """PocketSphinx decoder; thread-safe (one decode at a time, the decoder is stateful).

    Args:
        hmm: acoustic model directory; ``None`` = the US English model in the wheel.
        lm: n-gram language model file; ``None`` = the bundled US English one.
        dictionary: pronunciation dictionary file; ``None`` = the bundled cmudict.
    """

    name = "pocketsphinx"

    def __init__(
        self, hmm: Path | None = None, lm: Path | None = None, dictionary: Path | None = None
    ) -> None:
        try:
            from pocketsphinx import Decoder
        except ImportError as exc:
            raise ImportError("the pocketsphinx ASR needs: pip install 'omnistage[bench]'") from exc

        paths = {"hmm": hmm, "lm": lm, "dict": dictionary}
        self._decoder = Decoder(
            samprate=ASR_SAMPLE_RATE, **{k: str(v) for k, v in paths.items() if v is not None}
        )
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        """Lower-case words recognized in ``audio`` (see :meth:`ASRBackend.transcribe`)."""
        pcm = np.clip(to_asr_input(audio, sample_rate), -1.0, 1.0)
        if pcm.size == 0:
            return ""
        raw = (pcm * 32767.0).astype("<i2").tobytes()
        with self._lock:
            self._decoder.start_utt()
            self._decoder.process_raw(raw, full_utt=True)
            self._decoder.end_utt()
            hypothesis = self._decoder.hyp()
        return hypothesis.hypstr if hypothesis is not None else ""


class WhisperASR:
    """Whisper from a local checkpoint directory via ``transformers.pipeline``.

    Args:
        model_dir: a local Hugging Face Whisper checkpoint (no download is attempted).
        device: torch device for the pipeline, e.g. ``"cpu"`` or ``"cuda:0"``.
        language: spoken language passed to generation.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory.
        ImportError: ``transformers`` is not installed.
    """

    name = "whisper"

    def __init__(self, model_dir: str | Path, device: str = "cpu", language: str = "en") -> None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"Whisper model directory not found: {model_dir}")
        if importlib.util.find_spec("transformers") is None:
            raise ImportError("WhisperASR needs transformers: pip install transformers")
        from transformers import pipeline

        self._pipe = pipeline(
            "automatic-speech-recognition",
            model=str(model_dir),
            device=device,
            chunk_length_s=30,
        )
        self._language = language
        self._lock = threading.Lock()

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        """Text recognized in ``audio`` (see :meth:`ASRBackend.transcribe`)."""
        samples = to_asr_input(audio, sample_rate)
        if samples.size == 0:
            return ""
        with self._lock:
            result = self._pipe(
                {"raw": samples, "sampling_rate": ASR_SAMPLE_RATE},
                generate_kwargs={"language": self._language, "task": "transcribe"},
            )
        return str(result["text"]).strip()
