"""Stage factories of the Piper voice pipeline: preprocessing -> synthesis (terminal).

``preprocessing`` phonemizes each sentence (espeak-ng through piper-tts). ``synthesis``
runs the voice's ONNX graph with its own sentence-level continuous batching: every tick it
takes the next sentence of each active request (oldest request first), batches those that
can share one ONNX call, and streams each sentence's audio to the client as soon as it
exists, so a new request's first sentence never waits behind another request's last one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from omnistage.core.messages import Abort, StageInput, StagePayload
from omnistage.core.payloads import AudioChunk, AudioResult
from omnistage.models.piper.modeling import (
    MemoryArena,
    PiperPhonemizer,
    PiperSynthesizer,
    PiperVoiceSpec,
    SynthesisItem,
    change_speed,
    load_voice_spec,
)
from omnistage.models.piper.payload_types import PhonemizedText, PiperRequest
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import Scheduler, ThreadedScheduler

MIN_CAP_S = 10.0  # the output cap never goes below this many seconds


@lru_cache(maxsize=8)
def voice_spec(onnx_path: str) -> PiperVoiceSpec:
    """The voice at ``onnx_path`` (cached: read once per process)."""
    return load_voice_spec(Path(onnx_path))


def create_preprocessing_stage(ctx: StageBuildContext, num_workers: int = 2) -> ThreadedScheduler:
    """Sentences -> phoneme ids (:class:`PhonemizedText`)."""
    assert ctx.pipeline.model_path is not None
    phonemizer = PiperPhonemizer(voice_spec(ctx.pipeline.model_path))

    def compute(payload: StagePayload) -> PhonemizedText:
        request: PiperRequest = payload.request
        return PhonemizedText(tuple(tuple(phonemizer.phonemize(s)) for s in request.sentences))

    return ThreadedScheduler(compute, num_workers)


def create_synthesis_stage(
    ctx: StageBuildContext,
    max_batch_size: int = 4,
    max_length_ratio: float = 1.3,
    intra_op_threads: int = 2,
    max_seconds_per_phoneme: float = 0.25,
    max_audio_seconds: float = 900.0,
    memory_arena: MemoryArena = "shrink",
) -> SentenceScheduler:
    """The ONNX synthesis stage. ``max_length_ratio``: sentences share a call only if the
    longest has at most this many times the phonemes of the shortest, because every item
    of a call is decoded to the longest item's length (measured on CPU: a padded batch of
    0.5-5.3 s sentences cost 2.2x the same sentences alone).

    Output cap per request (reaching it finishes the request with "length"):
    ``max_seconds_per_phoneme`` x phoneme ids x ``length_scale`` (at least 10 s), and never
    more than ``max_audio_seconds``. Measured on en_US-joe-medium: at most 0.043 s per id
    per unit of length_scale with noise_w <= 0.8 (numbers, spelled letters, prose), and up
    to 0.22 with noise_w = 2, so the cap stops only runaway durations."""
    assert ctx.pipeline.model_path is not None
    synthesizer = PiperSynthesizer.load(voice_spec(ctx.pipeline.model_path), intra_op_threads, memory_arena)
    cap = OutputCap(max_seconds_per_phoneme, max_audio_seconds)
    return SentenceScheduler(synthesizer, max_batch_size, max_length_ratio, cap)


@dataclass(frozen=True)
class OutputCap:
    """Audio seconds a request may produce: ``seconds_per_phoneme`` per phoneme id, scaled
    by the request's length_scale and 1 / speed, at least ``MIN_CAP_S`` and at most
    ``max_seconds``."""

    seconds_per_phoneme: float
    max_seconds: float

    def __post_init__(self) -> None:
        if self.seconds_per_phoneme <= 0 or self.max_seconds < MIN_CAP_S:
            raise ValueError(f"need seconds_per_phoneme > 0 and max_seconds >= {MIN_CAP_S}")

    def samples(self, items: list[SynthesisItem], sample_rate: int, speed: float = 1.0) -> int:
        seconds = sum(len(i.phoneme_ids) * i.length_scale for i in items) * self.seconds_per_phoneme / speed
        return int(min(max(MIN_CAP_S, seconds), self.max_seconds) * sample_rate)


@dataclass
class _Utterance:
    items: list[SynthesisItem]
    max_samples: int
    speed: float = 1.0
    next: int = 0
    samples: int = 0


def _items(request: PiperRequest, text: PhonemizedText) -> list[SynthesisItem]:
    """One synthesis item per sentence (raises ValueError on invalid scales)."""
    r = request
    return [SynthesisItem(list(ids), r.noise_scale, r.length_scale, r.noise_w, r.speaker_id) for ids in text.sentences]


class SentenceScheduler(Scheduler):
    """Sentence-level continuous batching over a :class:`PiperSynthesizer`.

    Streams each sentence as an :class:`AudioChunk` (float32 ``[N]`` at the voice's
    sample rate) and finishes a request with an :class:`AudioResult` (``num_frames`` =
    sentences).
    """

    def __init__(
        self,
        synthesizer: PiperSynthesizer,
        max_batch_size: int,
        max_length_ratio: float,
        cap: OutputCap,
        release_callback: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(release_callback)
        if max_batch_size < 1 or max_length_ratio < 1.0:
            raise ValueError("need max_batch_size >= 1 and max_length_ratio >= 1")
        self.synthesizer = synthesizer
        self.sample_rate = synthesizer.spec.sample_rate
        self.max_batch_size, self.max_length_ratio, self.cap = max_batch_size, max_length_ratio, cap
        self.active: OrderedDict[str, _Utterance] = OrderedDict()

    def live_requests(self) -> set[str]:
        return set(self.active)

    def _run(self) -> None:
        while True:
            for message in self.take(block=not self.active):
                if message is None:
                    return
                self._accept(message)
            if self.active:
                self._step()

    def _accept(self, message: StageInput) -> None:
        if isinstance(message, StagePayload):
            items: list[SynthesisItem] = []
            if self.run_batch([message.request_id], lambda: items.extend(_items(message.request, message.data))):
                speed = message.request.speed
                cap = self.cap.samples(items, self.sample_rate, speed)
                self.active[message.request_id] = _Utterance(items, cap, speed)
        elif isinstance(message, Abort):
            if self.active.pop(message.request_id, None) is not None:
                self.release(message.request_id)

    def _pick(self) -> list[tuple[str, SynthesisItem]]:
        picked: list[tuple[str, SynthesisItem]] = []
        for request_id, utterance in self.active.items():
            item = utterance.items[utterance.next]
            if picked:
                first = picked[0][1]
                lengths = [len(first.phoneme_ids), len(item.phoneme_ids)]
                if item.scales != first.scales or max(lengths) > self.max_length_ratio * min(lengths):
                    continue
            picked.append((request_id, item))
            if len(picked) == self.max_batch_size:
                break
        return picked

    def _step(self) -> None:
        picked = self._pick()
        ids = [request_id for request_id, _ in picked]
        waves: list[np.ndarray] = []
        if not self.run_batch(ids, lambda: waves.extend(self._synthesize(picked))):
            for request_id in ids:
                self.active.pop(request_id, None)
            return
        for request_id, wave in zip(ids, waves, strict=True):
            utterance = self.active[request_id]
            wave = wave[: utterance.max_samples - utterance.samples]
            utterance.next += 1
            utterance.samples += len(wave)
            self.outbox.stream(request_id, AudioChunk(wave, self.sample_rate))
            capped = utterance.samples >= utterance.max_samples
            if capped or utterance.next == len(utterance.items):
                del self.active[request_id]
                phonemes = sum(len(item.phoneme_ids) for item in utterance.items)
                result = AudioResult(utterance.samples, self.sample_rate, num_frames=utterance.next, input_tokens=phonemes)
                self.outbox.result(request_id, result, "length" if capped else "stop")
            else:
                self.active.move_to_end(request_id)  # round robin: other requests go first

    def _synthesize(self, picked: list[tuple[str, SynthesisItem]]) -> list[np.ndarray]:
        """One ONNX call for the picked sentences, each then stretched to its request's speed."""
        waves = self.synthesizer.synthesize_batch([item for _, item in picked])
        speeds = [self.active[request_id].speed for request_id, _ in picked]
        return [change_speed(w, self.sample_rate, s) for w, s in zip(waves, speeds, strict=True)]
