"""Exact incremental decoding: per-stream decoder state in a fixed arena of slots.

A stream owns one slot of preallocated tensors holding everything a
:class:`~omnistage.engine.causal_vocoder.CarriedStateVocoder` carries between chunks (for
Qwen3-TTS's speech tokenizer at real dims: 29 tensors: 8 layers' keys and values of the
last 71 frames, 17 causal conv histories (the k=1 convs need none), 4 transposed-conv input
tails; plus the absolute frame position: 5.2 MB per slot in fp32, 2.6 MB in bf16), each of
the decoder's :meth:`~CarriedStateVocoder.state_shapes` (so in its layout: a channels-last
decoder's conv histories are ``[H, C]`` per slot; gathers and scatters index slots only, so
they do not depend on it). Decoding a chunk gathers the slots' state, runs
:meth:`CarriedStateVocoder.step` and scatters the new state back, so the concatenated
chunks equal the offline decode of all frames (shared/reference/qwen3-tts.md, section 6:
windowed re-decoding with a short left context does not).

On CUDA, :meth:`StreamingDecoderArena.capture_graphs` records one CUDA graph per (batch
bucket, chunk length); a call pads its batch to the bucket with a scratch slot and
replays, which removes the ~13 ms launch floor of the eager decoder (peer-baseline-h200.md).
All decoding runs on a dedicated high-priority stream, so vocoder chunks are not queued
behind the AR engine's kernels: codes that come from the host (the engine's frames) are
copied in on that stream, and the audio is copied out to the host on it, so a chunk never
waits for the engine's step on the default stream.

Opening streams (:meth:`StreamingDecoderArena.allocate_many`) is batched: the new slots are
reset together, and a left context (a voice clone's reference codes) is decoded ONCE per
content: the state after it is cached by the SHA-256 of the codes (architecture rule 8: a
content key, so one voice's state can never stand in for another's), and a stream that
opens with known reference codes copies that state instead of decoding them again (a
profile at 64 concurrent voice clones had a third of the vocoder thread in eager left-
context decodes, one stream at a time). With CUDA graphs an unseen left context is
decoded as replays of the captured chunk lengths (:func:`context_pieces`; Qwen3-TTS's
vocoder also captures 16, 32 and 64 frames for one or two streams:
:data:`DEFAULT_GRAPH_CONTEXT_LENGTHS`), not eagerly.

The arena serves every such decoder (Qwen3-TTS's and Qwen3-Omni's code2wav); a decoder
whose streams open with :attr:`~CarriedStateVocoder.leading_trim` samples that are not
audio gets them cut from its streams' first chunks (so those rows are shorter).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from omnistage.core.lru import BoundedLRU
from omnistage.engine.causal_vocoder import CarriedStateVocoder
from omnistage.engine.cuda_graph import capturing, device_synchronize

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXT_CACHE_SIZE = 64  # left-context states kept (2.6 MB each at real dims, bf16)
DEFAULT_GRAPH_CHUNK_LENGTHS = tuple(range(1, 9))  # the ramp 1, 2, 4, 8 and flushes of 1..8
#: Longer chunks captured for the smallest batches only, for left contexts (a reference clip
#: of 3 s is 38 frames, 30 s at most: 375): a replay costs about the same whatever its
#: length up to 8 frames (2.80 ms for 1 frame, 3.23 ms for 8 on the H200, 8.44 ms for 8
#: streams x 8; benchmarks/results/vocoder_gpu.json), so 38 frames in chunks of 8 would be
#: five replays, and 32 + 6 is two.
DEFAULT_GRAPH_CONTEXT_LENGTHS = (16, 32, 64)
CONTEXT_GRAPH_MAX_BATCH = 2
FULL_DECODE_CHUNK_FRAMES = 128


def graph_batch_buckets(requested: Sequence[int], num_slots: int) -> list[int]:
    """The batch sizes to capture vocoder graphs for: ``requested`` capped at ``num_slots``,
    then doubled from the largest until one holds ``num_slots`` (the last capped at it), so
    no batch of live streams falls back to eager decoding (at 128 streams on the H200,
    eager decoding of batches above 64 held 55% of the vocoder thread's busy samples:
    benchmarks/results/qwen3_tts_gpu_0.6b_pyspy.json), ascending.

    Raises:
        ValueError: ``requested`` is empty or holds a size < 1, or ``num_slots < 1``.
    """
    if not requested or min(requested) < 1 or num_slots < 1:
        raise ValueError(
            f"batch buckets must be >= 1 and num_slots >= 1, got {list(requested)}, {num_slots}"
        )
    buckets = {min(b, num_slots) for b in requested}
    while max(buckets) < num_slots:
        buckets.add(min(2 * max(buckets), num_slots))
    return sorted(buckets)


def context_pieces(frames: int, lengths: Sequence[int]) -> list[int]:
    """Split ``frames`` into chunks of the given ``lengths`` (the chunk lengths that have a
    graph), longest first, greedily: e.g. 38 with 1..8 -> [8, 8, 8, 8, 6]; a rest that no
    length fits (none is 1) is one last chunk; no lengths -> ``[frames]``.

    Raises:
        ValueError: ``frames < 1``.
    """
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    pieces, left = [], frames
    for n in sorted(set(lengths), reverse=True):
        while left >= n > 0:
            pieces.append(n)
            left -= n
    return pieces + [left] if left else pieces


class ArenaFullError(RuntimeError):
    """Every slot of the state arena is in use."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    codes: torch.Tensor  # [bucket, n, G] static input
    slots: torch.Tensor  # [bucket] int64 static input
    audio: torch.Tensor  # [bucket, n * spf] static output


class StreamingDecoderArena:
    """The speech tokenizer decoder with carried per-stream state in ``num_slots`` slots.

    Args:
        decoder: the decoder (its device and dtype are the arena's).
        num_slots: concurrent streams (64 by default: the reference server's arena size).
        context_cache_size: left-context states cached by content (0: none; least
            recently used out first).

    Not thread-safe: one scheduler thread drives it.
    """

    def __init__(
        self,
        decoder: CarriedStateVocoder,
        num_slots: int = 64,
        context_cache_size: int = DEFAULT_CONTEXT_CACHE_SIZE,
    ) -> None:
        if num_slots < 1 or context_cache_size < 0:
            raise ValueError(
                f"num_slots must be >= 1 and context_cache_size >= 0, got {num_slots}, {context_cache_size}"
            )
        self.decoder = decoder
        self.num_slots = num_slots
        self.samples_per_frame = decoder.samples_per_frame
        self.num_code_groups = decoder.num_quantizers
        weight = next(decoder.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        # slot num_slots is scratch: padding rows of a graph replay read and write it
        self._state = decoder.zero_state(num_slots + 1)
        self._positions = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self._frames = [0] * (num_slots + 1)  # host copy of _positions (read without a sync)
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._buckets: list[int] = []
        self._stream = (
            torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        )
        self.context_cache_size = context_cache_size
        # key -> the state rows [1, ...] after that left context
        self._contexts: BoundedLRU[str, list[torch.Tensor]] = BoundedLRU(
            max_entries=context_cache_size
        )

    @property
    def num_free(self) -> int:
        """Slots available to :meth:`allocate`."""
        return len(self._free)

    def allocate(self, left_context: torch.Tensor | None = None) -> int:
        """:meth:`allocate_many` of one stream."""
        return self.allocate_many([left_context])[0]

    @torch.inference_mode()
    def allocate_many(self, left_contexts: Sequence[torch.Tensor | None]) -> list[int]:
        """Take a slot with a fresh state per entry; with a left context (``[R, G]`` int64
        codes, e.g. a voice clone's reference codes) the state continues after it, its
        audio discarded: later chunks then continue the decode of ``left_context ++ codes``.
        Contexts not seen before are decoded once each, batched by length; known ones
        (by content) copy their cached state.

        Raises:
            ArenaFullError: fewer free slots than entries (nothing is taken).
            ValueError: a left context is not ``[R >= 1, G]``.
        """
        if len(left_contexts) > len(self._free):
            raise ArenaFullError(
                f"{len(left_contexts)} streams asked for; {len(self._free)} of {self.num_slots} vocoder state slots are free"
            )
        for context in left_contexts:
            if context is not None and (
                context.dim() != 2
                or context.shape[0] < 1
                or context.shape[1] != self.num_code_groups
            ):
                raise ValueError(
                    f"left_context must be [R>=1, {self.num_code_groups}], got {tuple(context.shape)}"
                )
        slots = [self._free.pop() for _ in left_contexts]
        self._used.update(slots)
        for slot, context in zip(slots, left_contexts, strict=True):
            self._frames[slot] = 0 if context is None else context.shape[0]
        with self._on_stream(*(c for c in left_contexts if c is not None)):
            index = torch.tensor(slots, device=self.device)
            for tensor in self._state:
                tensor.index_fill_(0, index, 0)
            self._positions.index_fill_(0, index, 0)
            with_context = [
                (slot, c) for slot, c in zip(slots, left_contexts, strict=True) if c is not None
            ]
            if with_context:
                self._restore_contexts(with_context)
        return slots

    def _restore_contexts(self, items: list[tuple[int, torch.Tensor]]) -> None:
        """Put each slot's state after its left context (fresh slots, on the arena's stream)."""
        hosts = [context.to("cpu", torch.int64) for _, context in items]
        keys = [
            hashlib.sha256(
                host.numpy().tobytes() + bytes(str(tuple(host.shape)), "ascii")
            ).hexdigest()
            for host in hosts
        ]
        cached = {key: state for key in keys if (state := self._contexts.get(key)) is not None}
        first: dict[str, int] = {}  # an uncached key -> the item that decodes it
        for i, key in enumerate(keys):
            if key not in cached and key not in first:
                first[key] = i
        by_length: dict[int, list[int]] = {}
        for i in first.values():
            by_length.setdefault(hosts[i].shape[0], []).append(i)
        fresh: dict[str, list[torch.Tensor]] = {}
        for group in by_length.values():
            group_slots = [items[i][0] for i in group]
            codes = torch.stack([hosts[i] for i in group]).to(self.device, non_blocking=True)
            start = 0
            for n in self._context_pieces(len(group), codes.shape[1]):
                self._decode_on_stream(group_slots, codes[:, start : start + n])
                start += n
            for i, slot in zip(group, group_slots, strict=True):
                fresh[keys[i]] = [tensor[slot : slot + 1].clone() for tensor in self._state]
        lengths = {key: hosts[i].shape[0] for i, key in enumerate(keys)}
        rest = [
            (slot, key)
            for (slot, _), key, i in zip(items, keys, range(len(items)), strict=True)
            if first.get(key) != i
        ]
        if rest:
            index = torch.tensor([slot for slot, _ in rest], device=self.device)
            states = [fresh.get(key) or cached[key] for _, key in rest]
            for layer, tensor in enumerate(self._state):
                tensor.index_copy_(0, index, torch.cat([state[layer] for state in states]))
            self._positions.index_copy_(
                0, index, torch.tensor([lengths[key] for _, key in rest], device=self.device)
            )
        self._contexts.put_many(fresh.items())

    def _context_pieces(self, batch: int, frames: int) -> list[int]:
        """The chunks a batch of ``batch`` left contexts of ``frames`` frames is decoded in:
        with CUDA graphs, the longest captured chunk lengths of the batch's bucket (a 3 s
        reference of 38 frames alone is replays of 32 and 6 frames, instead of an eager
        decode of 38 frames at the eager decoder's ~13 ms launch floor on the arena's
        thread); else one chunk. The decode carries its state, so any split continues
        the same stream (:func:`context_pieces`)."""
        at = bisect.bisect_left(self._buckets, batch)
        bucket = self._buckets[at] if at < len(self._buckets) else None
        return context_pieces(frames, [n for b, n in self._graphs if b == bucket])

    def free(self, slot: int) -> None:
        """Return ``slot`` to the arena; idempotent (freeing a free slot does nothing)."""
        if slot in self._used:
            self._used.discard(slot)
            self._free.append(slot)

    def position(self, slot: int) -> int:
        """Frames decoded so far in ``slot`` (left context included)."""
        return self._frames[slot]

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], codes: torch.Tensor) -> list[torch.Tensor]:
        """Decode the next ``n`` frames of each slot's stream, as one batch.

        Args:
            slots: ``B`` distinct allocated slots.
            codes: ``[B, n, G]`` int64 (any device; from the host, nothing waits for the
                device's other work), ``n >= 1``.

        Returns:
            Per slot ``[n * samples_per_frame]`` float32 PCM in [-1, 1], on the host (rows
            of one tensor); minus the decoder's ``leading_trim`` samples in a stream's
            first chunk.

        Raises:
            ValueError: a slot is not allocated or repeated, or ``codes`` has the wrong shape.
        """
        batch = len(slots)
        if len(set(slots)) != batch or not self._used.issuperset(slots):
            raise ValueError(f"slots must be distinct allocated slots, got {list(slots)}")
        if (
            codes.dim() != 3
            or codes.shape[0] != batch
            or codes.shape[1] < 1
            or codes.shape[2] != self.num_code_groups
        ):
            raise ValueError(
                f"codes must be [{batch}, n>=1, {self.num_code_groups}], got {tuple(codes.shape)}"
            )
        starts = [self._frames[slot] * self.samples_per_frame for slot in slots]
        for slot in slots:
            self._frames[slot] += codes.shape[1]
        with self._on_stream(codes):
            audio = self._decode_on_stream(slots, codes).float()
            if self._stream is not None:
                host = torch.empty(audio.shape, dtype=torch.float32, pin_memory=True)
                host.copy_(audio, non_blocking=True)
                self._stream.synchronize()
                audio = host
        trim = self.decoder.leading_trim
        return [row[max(0, trim - start) :] for row, start in zip(audio, starts, strict=True)]

    @contextlib.contextmanager
    def _on_stream(self, *inputs: torch.Tensor) -> Iterator[None]:
        """Run the block on the arena's stream (CUDA); it waits for the caller's stream only
        when an input lives on the device (host inputs are copied in on the arena's stream)."""
        if self._stream is None:
            yield
            return
        if any(t.is_cuda for t in inputs):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def _decode_on_stream(self, slots: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        """Decode on the current stream (the arena's, on CUDA): ``[B, n * spf]``, arena dtype."""
        if self._stream is None:
            return self._decode_eager(
                torch.tensor(slots, device=self.device), codes.to(self.device)
            )
        return self._decode_cuda(slots, codes)

    def _decode_eager(self, index: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        state = [t.index_select(0, index) for t in self._state]
        audio, new_state = self.decoder.step(codes, self._positions.index_select(0, index), state)
        for arena, new in zip(self._state, new_state, strict=True):
            arena.index_copy_(0, index, new)
        self._positions.index_add_(0, index, torch.full_like(index, codes.shape[1]))
        return audio

    def _decode_cuda(self, slots: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        batch, n = codes.shape[:2]
        at = bisect.bisect_left(self._buckets, batch)
        graph = self._graphs.get((self._buckets[at], n)) if at < len(self._buckets) else None
        if graph is None:
            index = torch.tensor(slots, device="cpu").to(self.device, non_blocking=True)
            return self._decode_eager(index, codes.to(self.device, non_blocking=True))
        graph.slots.fill_(self.num_slots)
        graph.slots[:batch].copy_(torch.tensor(slots), non_blocking=True)
        graph.codes.zero_()
        graph.codes[:batch].copy_(codes, non_blocking=True)
        graph.graph.replay()
        return graph.audio[:batch].clone()

    @torch.inference_mode()
    def capture_graphs(
        self,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        chunk_lengths: Sequence[int] = DEFAULT_GRAPH_CHUNK_LENGTHS,
        context_lengths: Sequence[int] = (),
    ) -> None:
        """Record a CUDA graph per (batch bucket, chunk length), and per (bucket up to
        :data:`CONTEXT_GRAPH_MAX_BATCH`, context length) for left contexts (a decoder whose
        streams open with them: Qwen3-TTS's, :data:`DEFAULT_GRAPH_CONTEXT_LENGTHS`), largest
        first, in one memory pool; later calls pad to the smallest bucket >= their batch and
        replay (other chunk lengths run eagerly). The buckets are :func:`graph_batch_buckets`, so
        every batch up to ``num_slots`` has one. Call at start-up, before serving; captured
        on the arena's stream, one capture at a time in the process
        (:func:`~omnistage.engine.cuda_graph.capturing`). Graphs
        only read and write the scratch slot while capturing, so live streams are untouched.

        Raises:
            RuntimeError: the decoder is not on a CUDA device.
        """
        if self._stream is None:
            raise RuntimeError("CUDA graphs need the decoder on a CUDA device")
        pool = torch.cuda.graph_pool_handle()
        buckets = graph_batch_buckets(batch_buckets, self.num_slots)
        shapes = {(b, n) for b in buckets for n in chunk_lengths}
        shapes |= {(b, n) for b in buckets if b <= CONTEXT_GRAPH_MAX_BATCH for n in context_lengths}
        for bucket, n in sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True):
            self._graphs[(bucket, n)] = self._capture(bucket, n, pool)
        self._buckets = buckets
        device_synchronize(self.device)

    def _capture(self, bucket: int, n: int, pool: tuple[int, int]) -> _Graph:
        slots = torch.full((bucket,), self.num_slots, dtype=torch.int64, device=self.device)
        codes = torch.zeros(bucket, n, self.num_code_groups, dtype=torch.int64, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for _ in range(2):  # warm-up outside the graph (kernel selection, workspaces)
                self._decode_eager(slots, codes)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, pool, self._stream):  # the process's capture lock, thread-local mode
            audio = self._decode_eager(slots, codes)
        return _Graph(graph, codes, slots, audio)

    @torch.inference_mode()
    def decode_full(
        self, items: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        """Offline decode of whole utterances in one batch, without slots.

        Args:
            items: per utterance ``(codes [T, G], left_context [R, G] or None)``, int64.

        Returns:
            Per utterance ``[T * samples_per_frame]`` PCM (the left context's audio
            dropped; without a left context, minus the decoder's ``leading_trim``
            samples). Decoding is causal, so right-padding every sequence to the longest
            and cutting each back is exact; it runs in chunks of 128 frames.

        Raises:
            ValueError: no items, or codes that are not ``[T >= 1, G]``.
        """
        if not items or any(
            c.dim() != 2 or c.shape[0] < 1 or c.shape[1] != self.num_code_groups for c, _ in items
        ):
            raise ValueError(
                f"decode_full needs utterances of codes [T>=1, {self.num_code_groups}]"
            )
        sequences = [
            c.to(self.device) if r is None else torch.cat([r.to(self.device), c.to(self.device)])
            for c, r in items
        ]
        longest = max(s.shape[0] for s in sequences)
        batch = torch.zeros(
            len(sequences), longest, self.num_code_groups, dtype=torch.int64, device=self.device
        )
        for i, sequence in enumerate(sequences):
            batch[i, : sequence.shape[0]] = sequence
        # chunked with a carried state: exact, and memory bounded by the chunk, not the
        # utterance (the last layers hold 96 channels x 1920 samples per frame)
        state = self.decoder.zero_state(len(sequences))
        positions = torch.zeros(len(sequences), dtype=torch.int64, device=self.device)
        pieces = []
        for start in range(0, longest, FULL_DECODE_CHUNK_FRAMES):
            chunk = batch[:, start : start + FULL_DECODE_CHUNK_FRAMES]
            piece, state = self.decoder.step(chunk, positions, state)
            positions = positions + chunk.shape[1]
            pieces.append(piece)
        audio = torch.cat(pieces, dim=1)
        spf = self.samples_per_frame
        out = []
        for i, (codes, left) in enumerate(items):
            begin = 0 if left is None else left.shape[0] * spf
            end = begin + codes.shape[0] * spf
            out.append(audio[i, max(begin, self.decoder.leading_trim) : end])
        return out
