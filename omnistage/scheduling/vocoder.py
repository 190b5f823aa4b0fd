"""VocoderScheduler: the streaming vocoder stage shared by every codec model.

Code frames arrive as :class:`~omnistage.scheduling.ar.CodeFrames` stream items
(``[n, G]`` int64 tensors, any ``n >= 1``, possibly on CUDA) from the AR engine; the
scheduler cuts them into a chunk plan (a ramp of 1, 2, 4 frames, then 8 at a time by
default, so the first audio needs one frame) and decodes each due chunk with a
:class:`StreamingCodecDecoder`, whose carried per-stream state makes the concatenated
chunks equal the offline decode. Due chunks of several requests with the same length are
decoded as ONE batch, and the streams that start in the same tick are opened as one batch
(:meth:`StreamingCodecDecoder.allocate_many`). At stream-done the remainder is flushed.

Each request's setup is a :class:`VocoderSetup`: the first chunk size, the left context
(a voice clone's reference codes: decoded into the state once, never emitted) and whether
to stream at all. It comes either as the stage payload or, when the payload only arrives
at the end (the engine's result), as a stream item from an earlier stage, so decoding
starts with the first frame. Code frames and stream-done may come before the setup; they
wait for it. The stage's own finish_reason is "stop": the framework carries the engine's
("length" when its cap was reached) to the client.

Output: :class:`~omnistage.core.payloads.AudioChunk` stream items (mono float32 numpy PCM,
as Piper's terminal stage), then an :class:`~omnistage.core.payloads.AudioResult`. A
non-streaming request (``stream=False``) is decoded whole at stream-done, batched with
the others finishing in the same tick, and emitted as one audio chunk. State slots are
freed on finish, abort and batch failure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from omnistage.core.payloads import AudioChunk, AudioResult
from omnistage.scheduling.ar import CodeFrames
from omnistage.scheduling.streaming import StreamingScheduler, StreamState


class StreamingCodecDecoder(Protocol):
    """What the scheduler needs from a codec decoder (e.g. Qwen3-TTS's
    ``StreamingDecoderArena``). Audio is PCM in [-1, 1]."""

    samples_per_frame: int

    @property
    def num_free(self) -> int:
        """Streams :meth:`allocate_many` can still open."""

    def allocate_many(self, left_contexts: Sequence[torch.Tensor | None]) -> list[int]:
        """Open one stream per entry, as one batch (decoding each ``left_context [R, G]``
        into its state, silently); returns their slots."""

    def decode(self, slots: Sequence[int], codes: torch.Tensor) -> list[torch.Tensor]:
        """The next ``n`` frames of each slot, ``codes [B, n, G]`` -> per slot ``[n * spf]``
        float32 on the host (fewer in a stream's first chunk when the codec's streams open
        with samples that are not audio: Qwen3-Omni's code2wav drops 555)."""

    def free(self, slot: int) -> None:
        """Close a stream; idempotent."""

    def decode_full(self, items: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Offline: per item ``(codes [T, G], left_context or None)`` -> ``[T * spf]``."""


@dataclass(frozen=True, slots=True)
class VocoderSetup:
    """A request's vocoder setup (a stream item, or the stage payload).

    Attributes:
        initial_codec_chunk_frames: frames of the first chunk; 0 = the plan's ramp. The
            request builder validates it (int >= 0); the scheduler clamps it to the plan's
            steady size.
        left_context: ``[R, G]`` int64 codes decoded before the stream and never emitted
            (voice-clone reference codes), or None.
        stream: False = decode the whole utterance at stream-done, one audio chunk.
        input_tokens: the request's input units, reported in its :class:`AudioResult`.
    """

    initial_codec_chunk_frames: int = 0
    left_context: torch.Tensor | None = None
    stream: bool = True
    input_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Frames per decoded chunk: ``ramp`` first, then ``steady`` forever.

    The default ramp (1, 2, 4) then 8 is the reference server's: the first audio needs one
    frame (80 ms at 12.5 Hz), later chunks amortize the decoder's per-call cost.

    Raises:
        ValueError: sizes below 1.
    """

    ramp: tuple[int, ...] = (1, 2, 4)
    steady: int = 8

    def __post_init__(self) -> None:
        if self.steady < 1 or any(size < 1 for size in self.ramp):
            raise ValueError(f"chunk sizes must be >= 1: ramp={self.ramp}, steady={self.steady}")

    def size(self, index: int, initial: int = 0) -> int:
        """Frames of chunk ``index`` (0-based). ``initial > 0`` replaces the ramp: the first
        chunk is ``min(initial, steady)`` frames and the rest are steady."""
        if initial > 0:
            return min(initial, self.steady) if index == 0 else self.steady
        return self.ramp[index] if index < len(self.ramp) else self.steady


@dataclass
class _Voice:
    """A request's vocoder state (``StreamState.model_state``)."""

    setup: VocoderSetup | None = None
    frames: list[torch.Tensor] = field(default_factory=list)  # buffered [n, G] pieces
    buffered: int = 0
    chunks_out: int = 0
    frames_out: int = 0
    samples_out: int = 0

    def take(self, n: int) -> torch.Tensor:
        """The next ``n`` buffered frames ``[n, G]``."""
        codes = torch.cat(self.frames) if len(self.frames) > 1 else self.frames[0]
        head, rest = codes[:n], codes[n:]
        self.frames = [rest] if rest.shape[0] else []
        self.buffered -= n
        return head


class VocoderScheduler(StreamingScheduler[_Voice]):
    """Streams audio from code-frame chunks through a :class:`StreamingCodecDecoder`.

    Args:
        decoder: the codec decoder (its slots bound concurrent streams: a request
            that finds no free slot waits, buffering its frames, until one frees).
        sample_rate: Hz of the decoder's output (24000 for Qwen3-TTS).
        plan: the chunk plan.
        release_callback: released per request on abort and failure, after the slot is freed.
    """

    def __init__(
        self,
        decoder: StreamingCodecDecoder,
        sample_rate: int,
        plan: ChunkPlan | None = None,
        release_callback: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(release_callback)
        self.decoder = decoder
        self.sample_rate = sample_rate
        self.plan = plan or ChunkPlan()
        self._slots: dict[str, int] = {}  # request id -> decoder slot
        self._waiting: dict[str, StreamState] = {}  # due work not done for lack of a slot

    # ------------------------------------------------------------------ lifecycle
    def release(self, request_id: str) -> None:
        """Free the request's decoder slot (idempotent), then the model's callback."""
        self._waiting.pop(request_id, None)
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.decoder.free(slot)
        super().release(request_id)

    def carried_over(self) -> dict[str, StreamState]:
        """Requests that found no free slot are retried once one is free."""
        return dict(self._waiting) if self._waiting and self.decoder.num_free > 0 else {}

    # ------------------------------------------------------------------ the tick
    def step(self, states: list[StreamState]) -> None:
        for state in states:  # those still without a slot are re-added by _open
            self._waiting.pop(state.request_id, None)
        live = [s for s in states if self._ingest_chunks(s)]
        ready = [s for s in live if s.model_state.setup is not None]
        self._finish_offline([s for s in ready if not self._payload(s).stream and self.ready_to_finish(s)])
        streaming, empty = [], []
        for state in (s for s in ready if self._payload(s).stream):
            if state.request_id not in self._slots and state.model_state.buffered == 0 and self.ready_to_finish(state):
                empty.append(state)  # no frames at all: finishes without a slot
            else:
                streaming.append(state)
        streaming = self._open(streaming)
        while due := [(s, n) for s in streaming if (n := self._due(s)) > 0]:
            groups: dict[int, list[StreamState]] = defaultdict(list)
            for state, n in due:
                groups[n].append(state)
            for n, group in groups.items():
                self._decode_group(group, n)
        for state in streaming:
            voice: _Voice = state.model_state
            if self.ready_to_finish(state) and voice.buffered == 0:
                self.decoder.free(self._slots.pop(state.request_id))
                self._complete(state)
        for state in empty:
            self._complete(state)

    def _ingest_chunks(self, state: StreamState) -> bool:
        """Buffer the state's new chunks and take its setup; a malformed chunk, setup or
        payload fails only its own request (returns False)."""
        voice = state.model_state = state.model_state or _Voice()
        for chunk in state.chunks:
            if isinstance(chunk.data, VocoderSetup):
                voice.setup = chunk.data
                continue
            if not isinstance(chunk.data, CodeFrames):
                name = type(chunk.data).__name__
                return self._reject(state, TypeError(f"vocoder: stream items are VocoderSetup or CodeFrames, got {name}"))
            codes = chunk.data.codes
            if codes.dim() != 2 or codes.shape[0] < 1 or codes.dtype != torch.int64:
                got = f"{tuple(codes.shape)} {codes.dtype}"
                return self._reject(state, ValueError(f"vocoder: code frames must be [n>=1, G] int64, got {got}"))
            voice.frames.append(codes)
            voice.buffered += codes.shape[0]
        state.chunks.clear()
        if voice.setup is None and state.payload is not None:
            if isinstance(state.payload.data, VocoderSetup):
                voice.setup = state.payload.data
            elif self.ready_to_finish(state):
                name = type(state.payload.data).__name__
                return self._reject(state, TypeError(f"vocoder: no setup arrived and the payload ({name}) is no VocoderSetup"))
        return True

    def _reject(self, state: StreamState, error: Exception) -> bool:
        self._release_state(state.request_id)
        self.release(state.request_id)
        self.outbox.fail(state.request_id, error)
        return False

    @staticmethod
    def _payload(state: StreamState) -> VocoderSetup:
        return state.model_state.setup  # set (and checked) by _ingest_chunks

    def _complete(self, state: StreamState) -> None:
        voice: _Voice = state.model_state
        tokens = self._payload(state).input_tokens
        result = AudioResult(voice.samples_out, self.sample_rate, num_frames=voice.frames_out, input_tokens=tokens)
        self.complete(state, result)

    def _open(self, states: list[StreamState]) -> list[StreamState]:
        """Give the requests without a decoder slot one, all in one batch, in order while
        slots are free (the others wait); returns the states that have a slot."""
        new = [s for s in states if s.request_id not in self._slots]
        opened, waiting = new[: self.decoder.num_free], new[self.decoder.num_free :]
        for state in waiting:
            self._waiting[state.request_id] = state
        if opened:
            slots = self.decoder.allocate_many([self._payload(s).left_context for s in opened])
            self._slots.update((s.request_id, slot) for s, slot in zip(opened, slots, strict=True))
        return [s for s in states if s.request_id in self._slots]

    def _due(self, state: StreamState) -> int:
        """Frames to decode now: the planned chunk once buffered, or the remainder after
        stream-done; 0 if nothing is due."""
        voice: _Voice = state.model_state
        planned = self.plan.size(voice.chunks_out, self._payload(state).initial_codec_chunk_frames or 0)
        if voice.buffered >= planned:
            return planned
        return voice.buffered if self.ready_to_finish(state) else 0

    def _decode_group(self, group: list[StreamState], n: int) -> None:
        codes = torch.stack([s.model_state.take(n) for s in group])
        rows = self.decoder.decode([self._slots[s.request_id] for s in group], codes)
        for state, row in zip(group, rows, strict=True):
            self._emit_audio(state, row.numpy(), n)

    def _emit_audio(self, state: StreamState, pcm: np.ndarray, frames: int) -> None:
        voice: _Voice = state.model_state
        voice.chunks_out += 1
        voice.frames_out += frames
        voice.samples_out += len(pcm)
        self.emit(state, AudioChunk(pcm, self.sample_rate))

    def _finish_offline(self, states: list[StreamState]) -> None:
        """Decode whole utterances in one batch, one audio chunk each, and finish them."""
        with_audio = [s for s in states if s.model_state.buffered > 0]
        if with_audio:
            items = [(s.model_state.take(s.model_state.buffered), self._payload(s).left_context) for s in with_audio]
            for state, (codes, _), audio in zip(with_audio, items, self.decoder.decode_full(items), strict=True):
                self._emit_audio(state, audio.float().cpu().numpy(), codes.shape[0])
        for state in states:
            self._complete(state)
