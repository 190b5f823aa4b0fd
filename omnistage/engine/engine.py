"""The AR engine: requests in, one frame per request per step out.

Usage::

    engine = AREngine(model, EngineConfig(kv_cache_bytes=...))
    engine.add_request("r1", GenerationInput(prompt, SamplingParams(...), max_new_tokens=200))
    while engine.has_work():
        for out in engine.step():
            ...  # out.frame [1, G] as soon as it exists; out.result once the request ended

A step is :meth:`AREngine.schedule` (host: pick the batch) then :meth:`AREngine.execute`
(launch it, then resolve frames). Frames leave the engine on the host: the stop check reads
code 0 back anyway, and the whole ``[B, G]`` frame of a step is one copy of ``16 B`` int64
into pinned memory, so consumers (a vocoder on its own CUDA stream, another process)
never wait on the engine's stream or map its memory.

Overlap (``EngineConfig.overlap``, on by default on CUDA): the host side of step ``t``
(waiting for its frames, the stop checks, handing them on, then scheduling and building
step ``t + 2``) runs while the device runs step ``t + 1``. The next step needs nothing from
the host (its input embeddings are made on the device from the frame kept in the
request's slot), so ``execute`` launches step ``t + 1`` first and only then waits for step
``t``'s frames: the one wait per step (an event after the frames' copy to the host) comes
when the device has the next step queued. A request that stopped at step ``t`` (a stop id,
seen only when its frames are read) has therefore also run in step ``t + 1``; that frame is
dropped, and its KV writes land in blocks that are freed only afterwards in stream order
(a request admitted into them writes them later on the same stream). A length stop is
known on the host before the launch and costs no extra step; an abort or a stop from the
stage (:meth:`AREngine.stop`) drops the frame in flight. A prefill step also decodes the
running requests (``BatchScheduler`` ``decode_with_prefill``), in one mixed step: the
prefill's forward, the decode's feed (input embeddings and backbone), then one frame tail
(code 0, the code predictor, sampling) over the running requests' rows and the prefill's
last rows together, so an arrival costs its forward but no tail of its own; the mixed step
goes in flight like a decode step (the newcomers' first frames are read while the next step
runs), and admissions never drain the device's queue. A prefill step with nothing running
beside it is resolved at once. A request gets the
same tokens as without overlap (its draws depend only on its own inputs and seed; only
which requests share a batch differs, as under any continuous batching), each frame handed
out a step later; the CPU tests check it token for token. Without overlap (the default on
CPU) each step is resolved right after it ran.

Own stream (``EngineConfig.own_stream``, CUDA only): the engine's device work (admission
writes, prefills, steps, the frames' copy out) runs on a CUDA stream of its own instead of
the caller's, so two engines of one process (the Qwen3-Omni thinker and talker, each on its
stage's thread) run their steps at once instead of one after the other on one stream, and a
step's wait is for the engine's own work only. Every hand-off between the streams is
ordered (docs/engine.md, "Own stream"): a method that takes device tensors
(:meth:`AREngine.add_request`, :meth:`AREngine.append_step_rows`) makes the engine's stream
wait for the caller's current stream (an event: the work that made them) and records the
tensors on the engine's stream (``record_stream``: the caching allocator does not reuse
their memory until the engine's stream is past them); the hidden rows it hands out
(``StepOutput.hidden``) are complete when they leave (their step's event was waited for)
and are recorded on the caller's current stream, where their readers in this process run.
The engine's CUDA graphs are captured on a stream of their own
(:class:`~omnistage.engine.cuda_graph.CUDAGraphRunner`), one capture at a time in the
process, and replayed on the engine's stream.

If a step raises, every request of it (the launched batch, a prefill's decode and the step
being resolved) ends with finish_reason ``"error"`` and frees its blocks before the
exception propagates to the caller's batch boundary.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from omnistage.core.errors import RequestValidationError
from omnistage.core.request import FinishReason
from omnistage.engine.block_manager import BlockManager
from omnistage.engine.cuda_graph import DEFAULT_PREFILL_TOKENS, CUDAGraphRunner, default_batch_sizes
from omnistage.engine.kv_cache import PagedKVCache, kv_pool_blocks, kv_token_bytes
from omnistage.engine.model_runner import ARModel, ARModelSpec, ModelRunner, StepSampling
from omnistage.engine.paged_attention import decode_attention_for
from omnistage.engine.scheduler import BatchScheduler, ScheduledBatch
from omnistage.engine.sequence import GenerationInput, GenerationResult, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs.

    Attributes:
        kv_cache_bytes: the KV pool's budget in bytes; None (the default): the pool holds
            ``max_num_seqs`` requests of ``max_model_len`` tokens (what the engine can ever
            use at once), on CUDA at most ``mem_fraction_static`` of the device memory
            free when the engine is built (after the weights). The rule:
            :func:`~omnistage.engine.kv_cache.kv_pool_blocks`.
        mem_fraction_static: in (0, 1]; the share of the free device memory the pool may
            take when ``kv_cache_bytes`` is None (CUDA only: on CPU the pool's pages are
            committed as tokens are written).
        block_size: tokens per KV block.
        max_num_seqs: running requests at most.
        max_waiting: queued requests at most (more -> QueueFullError).
        max_model_len: prompt + max_new_tokens at most per request.
        max_prefill_tokens: prompt tokens per coalesced prefill at most.
        prefill_hold_ms: how long waiting requests gather before a prefill while others
            decode (coalescing window).
        num_step_rows: rows of the step-embedding pool shared by running requests.
        cuda_graph_batch_sizes: decode buckets to capture; None = the default buckets up
            to ``max_num_seqs`` on CUDA; () = no graphs. Ignored on CPU.
        graph_sampling: sampling variants captured at start-up for every bucket beside the
            general one (e.g. the model's default request sampling), so serving never
            pauses to capture them on first use.
        cuda_graph_prefill_tokens: prefill buckets to capture, in tokens computed by one
            prefill (after its prefix-cache hits, summed over its requests): a prefill of
            at most the largest replays its forward padded up to its bucket, its rows
            attending through the block tables as decode steps do (the padding rows touch
            only the scratch block); a larger one, or one with hidden additions, runs
            eagerly. A small prefill is bound by kernel launches, not tokens (a known
            voice's ~15-token text after its cached prefix). None = the default buckets
            (:data:`~omnistage.engine.cuda_graph.DEFAULT_PREFILL_TOKENS`, 16 to 128) up to
            ``max_prefill_tokens`` on CUDA; () = none. Ignored on CPU.
        use_triton: Triton decode attention (None: on CUDA when installed).
        overlap: launch step t+1 before waiting for step t's frames, and decode the
            running requests in every prefill step, one frame tail for both (the module
            docstring); the same outputs, a step later. None: on CUDA (on CPU the device is the host, so there
            is nothing to overlap).
        prefix_caching: share the KV blocks of prompt prefixes between requests whose
            inputs have ``cache_prompt`` (a known voice's reference prefix is computed
            once); registered blocks nobody holds are evicted when the pool needs them
            (:mod:`omnistage.engine.block_manager`).
        own_stream: run the engine's device work on a CUDA stream of its own (the module
            docstring; docs/engine.md, "Own stream"); off: the caller's current stream.
            Ignored on CPU.
    """

    kv_cache_bytes: int | None = None
    mem_fraction_static: float = 0.5
    block_size: int = 16
    max_num_seqs: int = 64
    max_waiting: int = 1024
    max_model_len: int = 4096
    max_prefill_tokens: int = 8192
    prefill_hold_ms: float = 5.0
    num_step_rows: int = 65536
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    graph_sampling: tuple[StepSampling, ...] = ()
    cuda_graph_prefill_tokens: tuple[int, ...] | None = None
    use_triton: bool | None = None
    overlap: bool | None = None
    prefix_caching: bool = True
    own_stream: bool = False

    def __post_init__(self) -> None:
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        tokens = self.cuda_graph_prefill_tokens
        if tokens is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= self.max_prefill_tokens for t in tokens
        ):
            raise ValueError(
                f"cuda_graph_prefill_tokens must be token counts in 1..max_prefill_tokens "
                f"({self.max_prefill_tokens}), got {tokens!r}"
            )

    def prefill_graph_tokens(self) -> list[int]:
        """The prefill buckets to capture on CUDA (see ``cuda_graph_prefill_tokens``)."""
        if self.cuda_graph_prefill_tokens is not None:
            return sorted(set(self.cuda_graph_prefill_tokens))
        return [t for t in DEFAULT_PREFILL_TOKENS if t <= self.max_prefill_tokens]


@dataclass(frozen=True)
class StepOutput:
    """What one request got from a step: a new ``frame`` (``[1, G] int64``, on the host)
    and/or, if it ended, its ``result``; for a request with ``return_hidden``, ``hidden``:
    the states of ``spec.hidden_layers`` ``[n, K, H]`` (model dtype, on the device) of the
    tokens this step fed: the ``L`` prompt tokens with frame 0, then the previous frame's
    token with each frame (the last frame's come with the stop that ends the request; a
    request that ends by length never feeds its last frame, which so has none)."""

    request_id: str
    frame: torch.Tensor | None
    result: GenerationResult | None
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class StepPlan:
    """A step about to run: the batch to launch (if any; a prefill's may carry a decode,
    :attr:`ScheduledBatch.decode`: one mixed step) and the requests it may end (``request_ids``: the
    batch, its decode and the in-flight step it resolves)."""

    batch: ScheduledBatch | None
    request_ids: tuple[str, ...]


@dataclass
class _InFlight:
    seqs: list[Sequence]
    codes: torch.Tensor  # [B, G] host (pinned on CUDA; complete once `done` is reached)
    done: torch.cuda.Event | None
    hidden: list[torch.Tensor | None]  # per request: its hidden-layer rows, if it asked


class AREngine:
    """Continuous-batching AR engine over an :class:`ARModel` (see the module docstring).

    Args:
        model: the model (its ``spec.device`` is where everything runs).
        config: see :class:`EngineConfig`.

    Raises:
        ValueError: a KV pool that cannot hold one request of ``max_model_len`` (so a
            request that fits ``max_model_len`` always fits the pool: a request builder
            that checks ``max_model_len`` need not know the pool's size), or a bad
            ``mem_fraction_static`` (:func:`~omnistage.engine.kv_cache.kv_pool_blocks`).
    """

    def __init__(self, model: ARModel, config: EngineConfig) -> None:
        spec = model.spec
        self.config, self.device = config, spec.device
        self.cache = self._kv_pool(spec, config)
        self.kv_blocks = BlockManager(self.cache.num_usable_blocks, config.block_size)
        self.row_blocks = BlockManager(math.ceil(config.num_step_rows / config.block_size), config.block_size)
        is_cuda = spec.device.type == "cuda"
        self.stream = torch.cuda.Stream(spec.device) if is_cuda and config.own_stream else None
        self.overlap = is_cuda if config.overlap is None else config.overlap
        self.scheduler = BatchScheduler(
            self.kv_blocks, self.row_blocks, config.max_num_seqs, config.max_waiting,
            config.max_prefill_tokens, config.prefill_hold_ms / 1000, config.prefix_caching, self.overlap,
        )
        self.runner = ModelRunner(
            model, self.cache, decode_attention_for(spec.device, config.use_triton), config.max_num_seqs,
            self.row_blocks.num_blocks * config.block_size, math.ceil(config.max_model_len / config.block_size),
        )
        sizes = config.cuda_graph_batch_sizes
        sizes = default_batch_sizes(config.max_num_seqs) if sizes is None else list(sizes)
        prefill_tokens = config.prefill_graph_tokens()
        self.graphs = None
        if is_cuda and (sizes or prefill_tokens):
            with torch.no_grad():
                self.graphs = CUDAGraphRunner(self.runner, sizes, config.graph_sampling, prefill_tokens)
        if self.stream is not None:  # the pool and the slots' state were made on the caller's stream
            self.stream.wait_stream(torch.cuda.current_stream(spec.device))
        self._in_flight: _InFlight | None = None
        self.prefix_hit_tokens = 0  # prompt tokens taken from the prefix cache, ever

    @staticmethod
    def _kv_pool(spec: ARModelSpec, config: EngineConfig) -> PagedKVCache:
        token_bytes = kv_token_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
        # measured here, after the weights (and the stages built before this one)
        free = torch.cuda.mem_get_info(spec.device)[0] if spec.device.type == "cuda" else None
        blocks = kv_pool_blocks(
            token_bytes, config.block_size, config.max_num_seqs, config.max_model_len,
            config.kv_cache_bytes, config.mem_fraction_static, free,
        )  # fmt: skip
        logger.info(
            "KV pool: %d tokens, %.2f GiB (%d layers, %d bytes a token; need: max_num_seqs %d x max_model_len %d; "
            "kv_cache_bytes %s, mem_fraction_static %g, free bytes %s)",
            (blocks - 1) * config.block_size, blocks * config.block_size * token_bytes / 2**30, spec.num_layers,
            token_bytes, config.max_num_seqs, config.max_model_len, config.kv_cache_bytes,
            config.mem_fraction_static, free,
        )  # fmt: skip
        geometry = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        return PagedKVCache(*geometry, blocks, config.block_size, spec.dtype, spec.device)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, inputs: GenerationInput, now: float | None = None) -> None:
        """Queue a request (``now``: monotonic seconds, for tests).

        Raises:
            QueueFullError: the waiting queue is full.
            RequestValidationError: the request can never fit (``max_model_len``, which
                the KV pool always holds; the step-row pool) or its prompt width is not
                the model's hidden size. A model's request builder checks what its
                clients control first, before any model work (Qwen3-TTS: prompt + frames
                and step rows against ``max_model_len``); here they guard the engine.
            ValueError: ``request_id`` is already in the engine.
        """
        with self._taking(_input_tensors(inputs)):
            seq = Sequence(request_id, inputs, time.monotonic() if now is None else now)
        self._validate(seq)
        self.scheduler.add(seq)

    def append_step_rows(self, request_id: str, rows: torch.Tensor) -> bool:
        """Give a request given with ``more_rows`` its next step rows ``[K, H]`` (any
        device, float dtype; not to be written to afterwards). A step of the
        request that waited for them runs in the next batch. Rows past the request's
        capacity (one per frame that can be fed back) are dropped.

        Returns:
            False if the request is not in the engine (it ended; the rows are dropped).

        Raises:
            RequestValidationError: ``rows`` is not ``[K, hidden_size]`` floats.
            ValueError: the request was not given with ``more_rows``, or its rows are
                complete.
        """
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        if seq.rows_complete:
            raise ValueError(f"request {request_id!r} takes no more step rows")
        hidden = self.runner.spec.hidden_size
        if rows.dim() != 2 or rows.shape[1] != hidden or not rows.is_floating_point():
            raise RequestValidationError(
                f"step rows must be [K, {hidden}] floats, got {tuple(rows.shape)} {rows.dtype}", "step_rows"
            )
        with self._taking((rows,)):
            if seq.status is SequenceStatus.WAITING:
                seq.pending_rows.append(rows)
            else:
                self._store_rows(seq, rows)
        return True

    def complete_step_rows(self, request_id: str) -> bool:
        """No more step rows for the request: frames past its last row take the pad row
        (idempotent; a request without streamed rows is complete from the start).

        Returns:
            False if the request is not in the engine."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        seq.rows_complete = True
        return True

    def cap_new_tokens(self, request_id: str, max_new_tokens: int) -> bool:
        """Lower a request's frame cap (never raise it): it ends with ``"length"`` at
        ``max(max_new_tokens, frames launched, frames emitted + 1)`` frames, so frames
        already launched still land and a request at its new cap takes one more step to
        end. Its KV reservation is unchanged (freed whole when it ends).

        Returns:
            False if the request is not in the engine.

        Raises:
            ValueError: ``max_new_tokens < 1``.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        cap = max(max_new_tokens, seq.num_scheduled, len(seq.frames) + 1)
        seq.frame_cap = min(cap, seq.max_new_tokens)
        return True

    def _store_rows(self, seq: Sequence, rows: torch.Tensor) -> None:
        rows = rows[: seq.inputs.row_capacity - seq.num_rows]
        if rows.shape[0]:
            self.runner.write_rows(seq, seq.num_rows, rows)
            seq.num_rows += rows.shape[0]

    @contextlib.contextmanager
    def _taking(self, tensors: tuple[torch.Tensor, ...]) -> Iterator[None]:
        """Run the block on the engine's device stream, ordered after the caller's current
        stream's work so far (which made ``tensors``), with ``tensors`` recorded on the
        engine's stream (kept from reuse until it is past them); without an own stream, on
        the caller's."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    def _on_own_stream(self) -> contextlib.AbstractContextManager[object]:
        """The engine's own stream as the current one (a no-op without one)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def abort(self, request_id: str) -> None:
        """End a request now and free its blocks (unknown ids are ignored; idempotent).
        A frame of it still in flight is dropped when it resolves."""
        seq = self.scheduler.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def stop(self, request_id: str) -> None:
        """End a running request now as a success (finish_reason ``"stop"``), for a stop its
        stage found (a stop string, :mod:`omnistage.scheduling.stop_strings`): its blocks
        are freed as by :meth:`abort`, a frame of it still in flight is dropped, and the
        caller reports its result (unknown ids are ignored; idempotent)."""
        seq = self.scheduler.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, "stop")

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._in_flight)

    def wait_hint(self, now: float | None = None) -> float | None:
        """Seconds the caller may sleep before the next :meth:`step` has something to do
        (0: step now; None: idle until a request arrives)."""
        if self._in_flight is not None or any(s.schedulable for s in self.scheduler.running):
            return 0.0
        return self.scheduler.hold_remaining(time.monotonic() if now is None else now)

    def live_requests(self) -> set[str]:
        return self.scheduler.live_requests()

    # --------------------------------------------------------------------- steps
    def step(self, now: float | None = None) -> list[StepOutput]:
        """:meth:`schedule` then :meth:`execute`."""
        return self.execute(self.schedule(now))

    def schedule(self, now: float | None = None) -> StepPlan:
        """Pick the next step's batch (admitting waiting requests); pass the plan to
        :meth:`execute` before scheduling again."""
        batch = self.scheduler.schedule(time.monotonic() if now is None else now)
        seqs = (batch.seqs + batch.decode if batch else []) + (self._in_flight.seqs if self._in_flight else [])
        return StepPlan(batch, tuple(dict.fromkeys(s.request_id for s in seqs)))

    # Never autograd: a model with trainable parameters would otherwise chain every step's
    # graph through the persistent input buffers and hold all activations (seen on an H200:
    # serving ran out of memory after a few dozen requests).
    @torch.no_grad()
    def execute(self, plan: StepPlan) -> list[StepOutput]:
        """Launch ``plan.batch`` and resolve the frames that are due.

        Raises:
            whatever the model raises; the plan's requests have then ended with "error".
        """
        previous, self._in_flight = self._in_flight, None
        batch = plan.batch
        ok = False
        try:
            with self._on_own_stream():
                launched = self._launch(batch) if batch else None
            outputs = self._resolve(previous) if previous else []
            if launched is not None and self.overlap and (batch.kind == "decode" or batch.decode):
                self._in_flight = launched  # a decode or mixed step: resolved after the next launch
            elif launched is not None:
                # a prefill step alone (nothing decodes beside it): its frames, each
                # request's first, are resolved at once
                outputs += self._resolve(launched)
            ok = True
            return outputs
        finally:
            if not ok:
                self._fail(plan)

    def _launch(self, batch: ScheduledBatch) -> _InFlight:
        """Launch one step: a decode of the running requests, a prefill, or both in one
        mixed step (a prefill with :attr:`ScheduledBatch.decode`): the prefill's forward,
        then the decode's feed, then one frame tail over the decode rows and the
        prefill's last rows. The step's requests are in that order: decode, then prefill."""
        decode, prefill = (batch.decode, batch.seqs) if batch.kind == "prefill" else (batch.seqs, [])
        seqs = decode + prefill
        sampling = StepSampling.of(seqs)
        extra, prompt_layers = None, None
        if prefill:
            last, slot_ids, prompt_layers = self._prefill(prefill)
            extra = (last, slot_ids)
        if decode:
            codes, layers = self._decode(decode, sampling, extra)
        else:
            codes, layers = self._frame_tail(last, slot_ids, sampling), None
        # a decode request's rows are its fed token's, a prefill request's its computed prompt tokens'
        rows = [(layers, i, i + 1) for i in range(len(decode))]
        ends = list(itertools.accumulate((s.prompt_len - s.num_cached for s in prefill), initial=0))
        rows += [(prompt_layers, start, end) for start, end in zip(ends[:-1], ends[1:], strict=True)]
        # rows stay on the device; cloned: graph outputs are overwritten by the next replay
        hidden = [
            states[start:end].clone() if states is not None and seq.inputs.return_hidden else None
            for seq, (states, start, end) in zip(seqs, rows, strict=True)
        ]
        for seq in seqs:
            seq.num_scheduled += 1
        if self.device.type != "cuda":
            return _InFlight(seqs, codes.clone(), None, hidden)  # graph outputs are overwritten by the next replay
        host = torch.empty(codes.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(codes, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _InFlight(seqs, host, done, hidden)

    def _prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Admit ``seqs`` (their slots' state, their pending step rows) and launch their
        prefill's forward; returns :meth:`ModelRunner.prefill`'s outputs. Their prompt
        blocks are registered in the prefix cache (their KV is written, in stream order)."""
        for seq in seqs:
            self.runner.admit(seq)
            pending, seq.pending_rows = seq.pending_rows, []
            for rows in pending:
                self._store_rows(seq, rows)
        if self.graphs is not None and self.graphs.fits_prefill(seqs):
            outputs = self.graphs.prefill(seqs)
        else:
            outputs = self.runner.prefill(seqs)
        for seq in seqs:  # their KV is written (in stream order): later prompts may share it
            self.prefix_hit_tokens += seq.num_cached
            if seq.prompt_keys:
                self.kv_blocks.register(seq.request_id, seq.prompt_keys)
        return outputs

    def _frame_tail(self, last: torch.Tensor, slot_ids: torch.Tensor, sampling: StepSampling) -> torch.Tensor:
        """The first frames of a prefill step alone (no decode in it)."""
        if self.graphs is not None and last.shape[0] <= self.graphs.max_batch_size:
            return self.graphs.frame_tail(last, slot_ids, sampling)
        cache = self.runner.model.new_frame_cache(last.shape[0])
        return self.runner.frame_tail(last, slot_ids, cache, sampling)

    def _decode(
        self, seqs: list[Sequence], sampling: StepSampling, extra: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode of ``seqs`` whose one frame tail also covers ``extra`` (a prefill's last
        hidden and slot ids), if any: :meth:`ModelRunner.decode`."""
        meta = self.runner.decode_meta(seqs)
        rows = len(seqs) + (0 if extra is None else extra[0].shape[0])
        if self.graphs is not None and rows <= self.graphs.max_batch_size:
            return self.graphs.decode(meta, sampling, extra)
        width = math.ceil(int(meta[:, 2].max()) / self.config.block_size)
        cache = self.runner.model.new_frame_cache(rows)
        return self.runner.decode(self.runner.upload_meta(meta), cache, width, sampling, extra)

    def _resolve(self, step: _InFlight) -> list[StepOutput]:
        if step.done is not None:
            step.done.synchronize()
        if self.stream is not None:  # read by the caller's stream from here on (module docstring)
            caller = torch.cuda.current_stream(self.device)
            for rows in step.hidden:
                if rows is not None:
                    rows.record_stream(caller)
        outputs = []
        for i, (seq, code0) in enumerate(zip(step.seqs, step.codes[:, 0].tolist(), strict=True)):
            if seq.status is not SequenceStatus.RUNNING:  # aborted, or stopped a step ago
                continue
            if code0 in seq.stop_ids:
                outputs.append(StepOutput(seq.request_id, None, self._finish(seq, "stop"), step.hidden[i]))
                continue
            frame = step.codes[i : i + 1]
            seq.frames.append(frame)
            result = self._finish(seq, "length") if len(seq.frames) == seq.max_new_tokens else None
            outputs.append(StepOutput(seq.request_id, frame, result, step.hidden[i]))
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> GenerationResult:
        self.scheduler.finish(seq, reason)
        groups = self.runner.spec.num_code_groups
        codes = torch.cat(seq.frames) if seq.frames else torch.empty(0, groups, dtype=torch.int64)
        return GenerationResult(codes, reason, seq.prompt_len)

    def _fail(self, plan: StepPlan) -> None:
        for request_id in plan.request_ids:
            seq = self.scheduler.get(request_id)
            if seq is not None:
                self.scheduler.finish(seq, "error")

    def _validate(self, seq: Sequence) -> None:
        inputs, spec = seq.inputs, self.runner.spec
        if seq.prompt_len + seq.max_new_tokens > self.config.max_model_len:
            raise RequestValidationError(
                f"prompt ({seq.prompt_len}) + max_new_tokens ({seq.max_new_tokens}) exceeds the engine's "
                f"max_model_len {self.config.max_model_len}", "max_new_tokens",
            )
        if self.row_blocks.blocks_needed(inputs.num_step_rows) > self.row_blocks.num_blocks:
            raise RequestValidationError(f"{inputs.num_step_rows} step rows exceed the pool", "step_rows")
        if inputs.return_hidden and not spec.hidden_layers:
            raise RequestValidationError("this model returns no hidden states", "return_hidden")
        if spec.position_rows != 3 and (inputs.positions is not None or inputs.rope_delta):
            raise RequestValidationError("this model takes 1-D positions: no positions or rope_delta", "positions")
        additions = inputs.hidden_additions
        if additions is not None and len(additions.embeds) > spec.hidden_addition_layers:
            raise RequestValidationError(
                f"hidden_additions cover {len(additions.embeds)} layers; this model takes them at "
                f"{spec.hidden_addition_layers} at most", "hidden_additions",
            )
        widths = [t.shape[-1] for t in (inputs.step_rows, inputs.pad_embed) if t is not None]
        widths += [e.shape[-1] for e in additions.embeds] if additions is not None else []
        if inputs.prompt.dim() == 2:
            widths.append(inputs.prompt.shape[1])
        if any(w != spec.hidden_size for w in widths):
            raise RequestValidationError(f"embeddings must be {spec.hidden_size} wide, got {widths}", "prompt")


def _input_tensors(inputs: GenerationInput) -> tuple[torch.Tensor, ...]:
    """The tensors of a request's input the engine reads after :meth:`AREngine.add_request`
    (:meth:`AREngine._taking` records the device ones on the engine's stream)."""
    additions = inputs.hidden_additions
    extra = (additions.rows, *additions.embeds) if additions is not None else ()
    given = (inputs.prompt, inputs.step_rows, inputs.pad_embed, inputs.positions, *extra)
    return tuple(t for t in given if t is not None)
